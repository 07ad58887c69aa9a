//! Measurement CSVs: what `calibrate` and `eval` read.
//!
//! Two schemas are recognised by their header: the seed's datasets (`Filename`,
//! `Max GPU Memory (MiB)`; each row's network — MLP, CNN or Transformer, by the file name's
//! first key — is rebuilt from its file name; `Status` `OOM_CRASH` rows ran out of the GPU's
//! memory: [`Rows::did_not_fit`]) and gpumem's own
//! (`model`, `batch_size`, `measured_mib`, optional `optimizer`, `precision`, `source`, `input`,
//! `seq_len`, `gpus`). Other `*_mib` columns are kept as published estimates to compare against.
//!
//! `gpus` reads "N" or "N (note)"; N > 1 is a `torch.nn.DataParallel` job over N GPUs (the only
//! multi-GPU setup in the seed's data), measured per GPU. Its `batch_size` is what the script's
//! loader feeds the wrapper, except where the optimizer says `hf-trainer`: Hugging Face's Trainer
//! takes a per-device batch and feeds N times it.

use std::io::Read;

use crate::UnknownName;
use crate::families::{Cnn, Mlp, ModelSpec, SpecError, Transformer};
use crate::job::Optimizer;
use crate::job::Precision;
use crate::job::{InputShape, OptionOverrides, Outputs};
use crate::model::ModelRef;
use crate::units::mib_to_bytes;

/// A measurement CSV gpumem cannot read. One line: `FILE line N: [column C: ]what is wrong`.
#[derive(Debug, thiserror::Error)]
pub enum CsvError {
    /// Not well-formed CSV (the csv reader's message, on one line).
    #[error("{file} line {line}: {}", one_line(.source))]
    Malformed {
        file: String,
        line: usize,
        source: csv::Error,
    },
    #[error("{file} line 1: expected columns model, batch_size, measured_mib (or the seed's Filename, Max GPU Memory (MiB)); found {}", .found.join(", "))]
    Columns { file: String, found: Vec<String> },
    /// (`problem` is boxed: a model spec's error is large, and this is the common case's `Err`.)
    #[error("{file} line {line}: column {column}: {problem}")]
    Cell {
        file: String,
        line: usize,
        column: String,
        problem: Box<CellProblem>,
    },
    /// No row measured a peak (`with_status`: the file has a `status` column and no row is `ok`).
    #[error("{file}: no rows{}", if *with_status { " with status ok" } else { "" })]
    NoRows { file: String, with_status: bool },
}

/// What is wrong with one cell of a measurement CSV.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CellProblem {
    #[error("`{0}` is not a number")]
    NotNumber(String),
    #[error("{0} MiB is not a plausible memory size")]
    ImplausibleMib(f64),
    #[error("`{0}` is not a whole number")]
    NotWholeNumber(String),
    #[error("must be at least 1")]
    Zero,
    #[error("`{0}` does not start with a GPU count (1..=64)")]
    NotGpuCount(String),
    #[error("`{0}` is not a positive whole number")]
    NotPositive(String),
    #[error("`{0}` is not kept or dropped")]
    NotOutputs(String),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Name(#[from] UnknownName),
}

/// One measured training run.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// 1-based line in the file (the header is line 1).
    pub line: usize,
    pub label: String,
    /// `None`: the row names its model in a way gpumem cannot trace (say a bare `resnet50`).
    pub model: Option<ModelRef>,
    /// The whole batch (a data-parallel job's is what the wrapper splits).
    pub batch: u64,
    pub measured_bytes: u64,
    /// What the row says of its loop: columns `optimizer`, `precision`, `input` (`CxHxW`),
    /// `seq_len` (or an `input` like `seq512`), `gpus` above 1 (a data-parallel job), `outputs`
    /// (or `dropped` where the optimizer says `hf-trainer`).
    pub options: OptionOverrides,
    /// Published estimates in this row: (column name without `_mib`, bytes or none).
    pub published: Vec<(String, Option<u64>)>,
}

fn column(headers: &csv::StringRecord, name: &str) -> Option<usize> {
    headers.iter().position(|h| h.trim() == name)
}

/// Reads a measurement CSV's measured rows. Errors are one line: `NAME line N: column C: what is
/// wrong`.
pub fn read_measurements(name: &str, reader: impl Read) -> Result<Vec<Measurement>, CsvError> {
    Ok(read_rows(name, reader)?.measured)
}

/// A measurement CSV's rows: those that measured a peak, and those whose job did not fit on the
/// GPU (the seed's `OOM_CRASH`: a measurement too — the estimate should exceed the GPU).
#[derive(Debug, Clone, PartialEq)]
pub struct Rows {
    pub measured: Vec<Measurement>,
    /// `measured_bytes` is 0 in these.
    pub did_not_fit: Vec<Measurement>,
}

/// The network a seed dataset's file name describes, by its first key, and the batch size.
fn seed_model(filename: &str) -> Result<(ModelSpec, u64), SpecError> {
    if filename.starts_with("input_channels:") {
        Cnn::from_seed_filename(filename).map(|(m, b)| (ModelSpec::Cnn(m), b))
    } else if filename.starts_with("num_classes:") {
        Transformer::from_seed_filename(filename).map(|(m, b)| (ModelSpec::Transformer(m), b))
    } else {
        Mlp::from_seed_filename(filename).map(|(m, b)| (ModelSpec::Mlp(m), b))
    }
}

/// Reads a measurement CSV (see [`read_measurements`]), keeping the rows that did not fit.
pub fn read_rows(name: &str, reader: impl Read) -> Result<Rows, CsvError> {
    let mut rdr = csv::ReaderBuilder::new()
        .flexible(false)
        .from_reader(reader);
    let headers = rdr
        .headers()
        .map_err(|source| CsvError::Malformed {
            file: name.into(),
            line: 1,
            source,
        })?
        .clone();
    // A `model` column (gpumem's schema, or a collected dataset in the seed's schema plus
    // `model`) wins over rebuilding MLPs from the seed's `Filename`.
    let batch_col = column(&headers, "batch_size").or_else(|| column(&headers, "Batch Size"));
    let memory_col =
        column(&headers, "measured_mib").or_else(|| column(&headers, "Max GPU Memory (MiB)"));
    let generic = (column(&headers, "model"), batch_col, memory_col);
    let generic_ok = generic.0.is_some() && generic.1.is_some() && generic.2.is_some();
    let seed = column(&headers, "Filename")
        .zip(column(&headers, "Max GPU Memory (MiB)"))
        .filter(|_| !generic_ok);
    let status_col = column(&headers, "status");
    let seed_status_col = column(&headers, "Status");
    if seed.is_none() && !generic_ok {
        return Err(CsvError::Columns {
            file: name.into(),
            found: headers.iter().map(String::from).collect(),
        });
    }
    let published_cols: Vec<(usize, String)> = headers
        .iter()
        .enumerate()
        .filter(|(_, h)| h.ends_with("_mib") && *h != "measured_mib" && !h.starts_with("measured"))
        .map(|(i, h)| (i, h.trim_end_matches("_mib").to_string()))
        .collect();
    let (opt_col, prec_col, src_col) = (
        column(&headers, "optimizer"),
        column(&headers, "precision"),
        column(&headers, "source"),
    );
    let mut out = Vec::new();
    let mut did_not_fit = Vec::new();
    for (k, rec) in rdr.records().enumerate() {
        let line = k + 2;
        let rec = rec.map_err(|source| CsvError::Malformed {
            file: name.into(),
            line,
            source,
        })?;
        let get = |i: usize| rec.get(i).unwrap_or("").trim();
        // Collected rows that crashed, ran out of memory or timed out measure no peak.
        if status_col.is_some_and(|c| !get(c).is_empty() && get(c) != "ok") {
            continue;
        }
        let bad = |col: &str, problem: CellProblem| CsvError::Cell {
            file: name.into(),
            line,
            column: col.into(),
            problem: Box::new(problem),
        };
        let mib = |col: &str, v: &str| -> Result<u64, CsvError> {
            let x: f64 = v
                .parse()
                .map_err(|_| bad(col, CellProblem::NotNumber(v.into())))?;
            if !(x > 0.0 && x < 1e9) {
                return Err(bad(col, CellProblem::ImplausibleMib(x)));
            }
            Ok(mib_to_bytes(x))
        };
        let m = if let Some((fcol, mcol)) = seed {
            let (model, batch) = seed_model(get(fcol)).map_err(|e| bad("Filename", e.into()))?;
            let oom = seed_status_col.is_some_and(|c| get(c) == "OOM_CRASH");
            if !oom && get(mcol).parse::<f64>() == Ok(0.0) {
                continue; // the seed's script built no network (0 parameters) and measured nothing
            }
            let m = Measurement {
                line,
                label: get(fcol).to_string(),
                model: Some(ModelRef::Native(model)),
                batch,
                measured_bytes: if oom {
                    0
                } else {
                    mib("Max GPU Memory (MiB)", get(mcol))?
                },
                options: OptionOverrides {
                    optimizer: Some(Optimizer::ADAM),
                    precision: Some(Precision::Fp32),
                    ..OptionOverrides::default()
                },
                published: Vec::new(),
            };
            if oom {
                did_not_fit.push(m);
                continue;
            }
            m
        } else {
            let (mc, bc, vc) = (generic.0.unwrap(), generic.1.unwrap(), generic.2.unwrap());
            let label = get(mc).to_string();
            let reference = src_col
                .map(get)
                .filter(|s| s.contains(':'))
                .unwrap_or(&label)
                .to_string();
            let model = ModelRef::recognise(&reference).map_err(|e| bad("model", e.into()))?;
            let mut batch: u64 = get(bc)
                .parse()
                .map_err(|_| bad(&headers[bc], CellProblem::NotWholeNumber(get(bc).into())))?;
            if batch == 0 {
                return Err(bad(&headers[bc], CellProblem::Zero));
            }
            let gpus = match column(&headers, "gpus").map(get).filter(|s| !s.is_empty()) {
                None => 1,
                Some(s) => s
                    .split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|n| n.parse::<u32>().ok())
                    .filter(|n| (1..=64).contains(n))
                    .ok_or_else(|| bad("gpus", CellProblem::NotGpuCount(s.into())))?,
            };
            if gpus > 1 && opt_col.map(get).is_some_and(|s| s.contains("hf-trainer")) {
                batch *= u64::from(gpus);
            }
            let optimizer = match opt_col.map(get).filter(|s| !s.is_empty()) {
                None => None,
                // "adamw(hf-trainer)" style annotations keep their optimizer name.
                Some(s) => Some(
                    Optimizer::parse(s.split('(').next().unwrap_or(s))
                        .map_err(|e| bad("optimizer", e.into()))?,
                ),
            };
            let precision = match prec_col.map(get).filter(|s| !s.is_empty()) {
                None => None,
                Some(s) => Some(Precision::parse(s).map_err(|e| bad("precision", e.into()))?),
            };
            let published = published_cols
                .iter()
                .map(|(i, n)| {
                    (
                        n.clone(),
                        get(*i)
                            .parse::<f64>()
                            .ok()
                            .filter(|x| *x > 0.0)
                            .map(mib_to_bytes),
                    )
                })
                .collect();
            let input_text = column(&headers, "input").map(get).unwrap_or("");
            let input = InputShape::parse(input_text);
            let seq_len = match column(&headers, "seq_len")
                .map(get)
                .filter(|s| !s.is_empty())
            {
                Some(s) => Some(
                    s.parse::<u64>()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| bad("seq_len", CellProblem::NotPositive(s.into())))?,
                ),
                None => input_text.strip_prefix("seq").and_then(|s| s.parse().ok()),
            };
            let data_parallel = (gpus > 1).then_some(gpus);
            let outputs = match column(&headers, "outputs")
                .map(get)
                .filter(|s| !s.is_empty())
            {
                Some(s) => Some(
                    Outputs::parse(s)
                        .map_err(|_| bad("outputs", CellProblem::NotOutputs(s.into())))?,
                ),
                None => opt_col
                    .map(get)
                    .is_some_and(|s| s.contains("hf-trainer"))
                    .then_some(Outputs::Dropped),
            };
            let options = OptionOverrides {
                optimizer,
                precision,
                input,
                seq_len,
                data_parallel,
                outputs,
            };
            Measurement {
                line,
                label,
                model,
                batch,
                measured_bytes: mib(&headers[vc], get(vc))?,
                options,
                published,
            }
        };
        out.push(m);
    }
    if out.is_empty() {
        return Err(CsvError::NoRows {
            file: name.into(),
            with_status: status_col.is_some(),
        });
    }
    Ok(Rows {
        measured: out,
        did_not_fit,
    })
}

fn one_line(e: &csv::Error) -> String {
    e.to_string().replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generic_schema_and_errors() {
        let ok = "model,batch_size,measured_mib,horus_mib\n\"mlp:input=8,output=2,depth=1\",32,1500,2000\nresnet50,32,3934,\n";
        let rows = read_measurements("d.csv", ok.as_bytes()).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[0].published,
            vec![("horus".to_string(), Some(2000 << 20))]
        );
        assert_eq!(rows[1].model, None);
        let e = read_measurements(
            "d.csv",
            "model,batch_size,measured_mib\n\"mlp:input=8,output=2,depth=1\",x,1500\n".as_bytes(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "d.csv line 2: column batch_size: `x` is not a whole number"
        );
        let e = read_measurements("d.csv", "a,b\n1,2\n".as_bytes()).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("d.csv line 1: expected columns model, batch_size, measured_mib"),
            "{e}"
        );
        let e = read_measurements(
            "d.csv",
            "model,batch_size,measured_mib\n\"mlp:input=8,output=2,depth=1\",4,-3\n".as_bytes(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "d.csv line 2: column measured_mib: -3 MiB is not a plausible memory size"
        );
        let e = read_measurements(
            "d.csv",
            "model,batch_size,measured_mib\nmlp:input=8,4\n".as_bytes(),
        )
        .unwrap_err();
        assert!(
            e.to_string().starts_with("d.csv line 2: ") && !e.to_string().contains('\n'),
            "{e}"
        );
    }

    #[test]
    fn the_seeds_cnn_and_transformer_rows_and_those_that_did_not_fit() {
        let csv = "Filename,Batch Size,Max GPU Memory (MiB),Status\n\
            input_channels:3_num_classes:99_depth:14_arch:uniform_base_filters:121_batch:34_input_size:90_act:elu_dropout:0.37_dropout:False_batchnorm:False.out,34,6293,SUCCESSFUL\n\
            num_classes:273_embedding_size:128_num_layers:8_num_heads:8_ff_hidden_size:332_dropout_rate:0.16_seq_length:512_input_size:553893_num_samples:1527_batch_size:64.out,64,5217,SUCCESSFUL\n\
            input_channels:3_num_classes:10_depth:40_arch:dense_base_filters:64_batch:512_input_size:224_act:relu_dropout:0.1_dropout:True_batchnorm:True.out,512,38217,OOM_CRASH\n";
        let rows = read_rows("s.csv", csv.as_bytes()).unwrap();
        assert_eq!(rows.measured.len(), 2);
        let Some(ModelRef::Native(ModelSpec::Cnn(c))) = &rows.measured[0].model else {
            panic!("a CNN")
        };
        assert_eq!(
            (
                c.channels,
                c.classes,
                c.depth,
                c.filters,
                c.input,
                c.dropout,
                c.pooling,
                rows.measured[0].batch
            ),
            (3, 99, 14, 121, 90, 0.0, false, 34)
        );
        let Some(ModelRef::Native(ModelSpec::Transformer(t))) = &rows.measured[1].model else {
            panic!("a Transformer")
        };
        assert_eq!(
            (
                t.vocab,
                t.embed,
                t.layers,
                t.heads,
                t.ff,
                t.seq,
                t.classes,
                t.samples,
                rows.measured[1].batch
            ),
            (553893, 128, 8, 8, 332, 512, 273, Some(1527), 64)
        );
        assert_eq!(
            (
                rows.did_not_fit.len(),
                rows.did_not_fit[0].batch,
                rows.did_not_fit[0].line
            ),
            (1, 512, 4)
        );
        let e = read_rows(
            "s.csv",
            "Filename,Max GPU Memory (MiB)\ninput_channels:3_num_classes:x.out,5\n".as_bytes(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "s.csv line 2: column Filename: seed filename `input_channels:3_num_classes:x.out`: missing `depth:`"
        );
    }

    #[test]
    fn data_parallel_rows() {
        let csv = "model,batch_size,measured_mib,optimizer,gpus\n\
                   a,8,100,adamw,1\n\
                   b,8,100,adamw,2 (torch.nn.DataParallel)\n\
                   c,4,100,adamw(hf-trainer),2 (data parallel)\n";
        let rows = read_measurements("d.csv", csv.as_bytes()).unwrap();
        assert_eq!(
            rows.iter()
                .map(|r| (r.batch, r.options.data_parallel))
                .collect::<Vec<_>>(),
            vec![(8, None), (8, Some(2)), (8, Some(2))]
        );
        let e = read_measurements(
            "d.csv",
            "model,batch_size,measured_mib,gpus\na,8,100,two\n".as_bytes(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "d.csv line 2: column gpus: `two` does not start with a GPU count (1..=64)"
        );
        let e = read_measurements(
            "d.csv",
            "model,batch_size,measured_mib,status\na,8,100,oom\n".as_bytes(),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "d.csv: no rows with status ok");
        let e = read_measurements(
            "d.csv",
            "model,batch_size,measured_mib,optimizer\na,8,100,lamb\n".as_bytes(),
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("d.csv line 2: column optimizer: unknown optimizer `lamb` (expected adam, adamw, sgd, sgd-momentum,"),
            "{e}"
        );
    }
}
