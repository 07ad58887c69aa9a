//! Measurement CSVs: what `calibrate` and `eval` read.
//!
//! Two schemas are recognised by their header: the seed's MLP dataset (`Filename`,
//! `Max GPU Memory (MiB)`; each row's network is rebuilt from its file name) and gpumem's own
//! (`model`, `batch_size`, `measured_mib`, optional `optimizer`, `precision`, `source`, `input`,
//! `seq_len`, `gpus`). Other `*_mib` columns are kept as published estimates to compare against.
//!
//! `gpus` reads "N" or "N (note)"; N > 1 is a `torch.nn.DataParallel` job over N GPUs (the only
//! multi-GPU setup in the seed's data), measured per GPU. Its `batch_size` is what the script's
//! loader feeds the wrapper, except where the optimizer says `hf-trainer`: Hugging Face's Trainer
//! takes a per-device batch and feeds N times it.

use std::io::Read;

use crate::UnknownName;
use crate::families::{Mlp, ModelSpec, SpecError};
use crate::graph::Precision;
use crate::step::Optimizer;
use crate::units::mib_to_bytes;
use crate::workload::{InputShape, ModelRef, OptionOverrides, Outputs};

/// A measurement CSV gpumem cannot read. One line: `FILE line N: [column C: ]what is wrong`.
#[derive(Debug, thiserror::Error)]
pub enum CsvError {
    /// Not well-formed CSV (the csv reader's message, on one line).
    #[error("{file} line {line}: {}", one_line(.source))]
    Malformed { file: String, line: usize, source: csv::Error },
    #[error("{file} line 1: expected columns model, batch_size, measured_mib (or the seed's Filename, Max GPU Memory (MiB)); found {}", .found.join(", "))]
    Columns { file: String, found: Vec<String> },
    /// (`problem` is boxed: a model spec's error is large, and this is the common case's `Err`.)
    #[error("{file} line {line}: column {column}: {problem}")]
    Cell { file: String, line: usize, column: String, problem: Box<CellProblem> },
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

/// Reads a measurement CSV. Errors are one line: `NAME line N: column C: what is wrong`.
pub fn read_measurements(name: &str, reader: impl Read) -> Result<Vec<Measurement>, CsvError> {
    let mut rdr = csv::ReaderBuilder::new().flexible(false).from_reader(reader);
    let headers = rdr.headers().map_err(|source| CsvError::Malformed { file: name.into(), line: 1, source })?.clone();
    // A `model` column (gpumem's schema, or a collected dataset in the seed's schema plus
    // `model`) wins over rebuilding MLPs from the seed's `Filename`.
    let batch_col = column(&headers, "batch_size").or_else(|| column(&headers, "Batch Size"));
    let memory_col = column(&headers, "measured_mib").or_else(|| column(&headers, "Max GPU Memory (MiB)"));
    let generic = (column(&headers, "model"), batch_col, memory_col);
    let generic_ok = generic.0.is_some() && generic.1.is_some() && generic.2.is_some();
    let seed = column(&headers, "Filename").zip(column(&headers, "Max GPU Memory (MiB)")).filter(|_| !generic_ok);
    let status_col = column(&headers, "status");
    if seed.is_none() && !generic_ok {
        return Err(CsvError::Columns { file: name.into(), found: headers.iter().map(String::from).collect() });
    }
    let published_cols: Vec<(usize, String)> = headers
        .iter()
        .enumerate()
        .filter(|(_, h)| h.ends_with("_mib") && *h != "measured_mib" && !h.starts_with("measured"))
        .map(|(i, h)| (i, h.trim_end_matches("_mib").to_string()))
        .collect();
    let (opt_col, prec_col, src_col) = (column(&headers, "optimizer"), column(&headers, "precision"), column(&headers, "source"));
    let mut out = Vec::new();
    for (k, rec) in rdr.records().enumerate() {
        let line = k + 2;
        let rec = rec.map_err(|source| CsvError::Malformed { file: name.into(), line, source })?;
        let get = |i: usize| rec.get(i).unwrap_or("").trim();
        // Collected rows that crashed, ran out of memory or timed out measure no peak.
        if status_col.is_some_and(|c| !get(c).is_empty() && get(c) != "ok") {
            continue;
        }
        let bad = |col: &str, problem: CellProblem| CsvError::Cell { file: name.into(), line, column: col.into(), problem: Box::new(problem) };
        let mib = |col: &str, v: &str| -> Result<u64, CsvError> {
            let x: f64 = v.parse().map_err(|_| bad(col, CellProblem::NotNumber(v.into())))?;
            if !(x > 0.0 && x < 1e9) {
                return Err(bad(col, CellProblem::ImplausibleMib(x)));
            }
            Ok(mib_to_bytes(x))
        };
        let m = if let Some((fcol, mcol)) = seed {
            let (mlp, batch) = Mlp::from_seed_filename(get(fcol)).map_err(|e| bad("Filename", e.into()))?;
            Measurement {
                line,
                label: get(fcol).to_string(),
                model: Some(ModelRef::Native(ModelSpec::Mlp(mlp))),
                batch,
                measured_bytes: mib("Max GPU Memory (MiB)", get(mcol))?,
                options: OptionOverrides { optimizer: Some(Optimizer::Adam), precision: Some(Precision::Fp32), ..OptionOverrides::default() },
                published: Vec::new(),
            }
        } else {
            let (mc, bc, vc) = (generic.0.unwrap(), generic.1.unwrap(), generic.2.unwrap());
            let label = get(mc).to_string();
            let reference = src_col.map(get).filter(|s| s.contains(':')).unwrap_or(&label).to_string();
            let model = ModelRef::recognise(&reference).map_err(|e| bad("model", e.into()))?;
            let mut batch: u64 = get(bc).parse().map_err(|_| bad(&headers[bc], CellProblem::NotWholeNumber(get(bc).into())))?;
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
                Some(s) => Some(Optimizer::parse(s.split('(').next().unwrap_or(s)).map_err(|e| bad("optimizer", e.into()))?),
            };
            let precision = match prec_col.map(get).filter(|s| !s.is_empty()) {
                None => None,
                Some(s) => Some(Precision::parse(s).map_err(|e| bad("precision", e.into()))?),
            };
            let published = published_cols
                .iter()
                .map(|(i, n)| (n.clone(), get(*i).parse::<f64>().ok().filter(|x| *x > 0.0).map(mib_to_bytes)))
                .collect();
            let input_text = column(&headers, "input").map(get).unwrap_or("");
            let input = InputShape::parse(input_text);
            let seq_len = match column(&headers, "seq_len").map(get).filter(|s| !s.is_empty()) {
                Some(s) => Some(s.parse::<u64>().ok().filter(|&n| n > 0).ok_or_else(|| bad("seq_len", CellProblem::NotPositive(s.into())))?),
                None => input_text.strip_prefix("seq").and_then(|s| s.parse().ok()),
            };
            let data_parallel = (gpus > 1).then_some(gpus);
            let outputs = match column(&headers, "outputs").map(get).filter(|s| !s.is_empty()) {
                Some(s) => Some(Outputs::parse(s).map_err(|_| bad("outputs", CellProblem::NotOutputs(s.into())))?),
                None => opt_col.map(get).is_some_and(|s| s.contains("hf-trainer")).then_some(Outputs::Dropped),
            };
            let options = OptionOverrides { optimizer, precision, input, seq_len, data_parallel, outputs };
            Measurement { line, label, model, batch, measured_bytes: mib(&headers[vc], get(vc))?, options, published }
        };
        out.push(m);
    }
    if out.is_empty() {
        return Err(CsvError::NoRows { file: name.into(), with_status: status_col.is_some() });
    }
    Ok(out)
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
        assert_eq!(rows[0].published, vec![("horus".to_string(), Some(2000 << 20))]);
        assert_eq!(rows[1].model, None);
        let e = read_measurements("d.csv", "model,batch_size,measured_mib\n\"mlp:input=8,output=2,depth=1\",x,1500\n".as_bytes()).unwrap_err();
        assert_eq!(e.to_string(), "d.csv line 2: column batch_size: `x` is not a whole number");
        let e = read_measurements("d.csv", "a,b\n1,2\n".as_bytes()).unwrap_err();
        assert!(e.to_string().starts_with("d.csv line 1: expected columns model, batch_size, measured_mib"), "{e}");
        let e = read_measurements("d.csv", "model,batch_size,measured_mib\n\"mlp:input=8,output=2,depth=1\",4,-3\n".as_bytes()).unwrap_err();
        assert_eq!(e.to_string(), "d.csv line 2: column measured_mib: -3 MiB is not a plausible memory size");
        let e = read_measurements("d.csv", "model,batch_size,measured_mib\nmlp:input=8,4\n".as_bytes()).unwrap_err();
        assert!(e.to_string().starts_with("d.csv line 2: ") && !e.to_string().contains('\n'), "{e}");
    }

    #[test]
    fn data_parallel_rows() {
        let csv = "model,batch_size,measured_mib,optimizer,gpus\n\
                   a,8,100,adamw,1\n\
                   b,8,100,adamw,2 (torch.nn.DataParallel)\n\
                   c,4,100,adamw(hf-trainer),2 (data parallel)\n";
        let rows = read_measurements("d.csv", csv.as_bytes()).unwrap();
        assert_eq!(rows.iter().map(|r| (r.batch, r.options.data_parallel)).collect::<Vec<_>>(), vec![(8, None), (8, Some(2)), (8, Some(2))]);
        let e = read_measurements("d.csv", "model,batch_size,measured_mib,gpus\na,8,100,two\n".as_bytes()).unwrap_err();
        assert_eq!(e.to_string(), "d.csv line 2: column gpus: `two` does not start with a GPU count (1..=64)");
        let e = read_measurements("d.csv", "model,batch_size,measured_mib,status\na,8,100,oom\n".as_bytes()).unwrap_err();
        assert_eq!(e.to_string(), "d.csv: no rows with status ok");
        let e = read_measurements("d.csv", "model,batch_size,measured_mib,optimizer\na,8,100,lion\n".as_bytes()).unwrap_err();
        assert_eq!(e.to_string(), "d.csv line 2: column optimizer: unknown optimizer `lion` (expected adam, adamw, sgd or sgd-momentum)");
    }
}
