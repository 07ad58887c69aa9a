//! `gpumem calibrate`: fit a GPU profile's fixed costs on measured rows chosen by a rule.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use gpumem_core::calibrate::fit_context;
use gpumem_core::dataset::Measurement;
use gpumem_core::families::ModelSpec;
use gpumem_core::trace::Trace;
use gpumem_workload::{ModelRef, OptionOverrides};

use crate::args::{GpuChoice, WorkloadArgs, read_csv, row_trace};
use crate::{CliError, CliResult};

#[derive(Args)]
pub struct CalibrateArgs {
    /// Measurements CSV (columns model, batch_size, measured_mib[, optimizer, precision], or the
    /// seed's MLP schema).
    measurements: Option<PathBuf>,
    /// Instead of a CSV: the daemon's state directory; its finished jobs with a model and a
    /// measured peak are the rows (their job ids are the `lines`).
    #[arg(long, conflicts_with = "measurements")]
    from_history: Option<PathBuf>,
    #[command(flatten)]
    gpu: GpuChoice,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Which rows to fit on, chosen by a rule and never by error: `all`, `first:N`,
    /// `smallest:N` (the N rows with the fewest parameters), or `lines:L1,L2` (file lines).
    #[arg(long, default_value = "all")]
    rows: String,
    /// Where to write the calibrated profile.
    #[arg(long)]
    out: PathBuf,
}

/// Finished daemon jobs with a model, a batch and a measured peak, as measurement rows.
fn history_rows(state: &Path) -> CliResult<Vec<Measurement>> {
    let db = state.join("jobs.db");
    if !db.exists() {
        return Err(CliError::input(format!(
            "{}: no job store here (a `gpumem serve --state` directory?)",
            state.display()
        )));
    }
    let store = gpumem_server::store::Store::open(&db).map_err(CliError::input)?;
    let rows: Vec<Measurement> = store
        .load()
        .map_err(CliError::input)?
        .into_iter()
        .filter(|j| j.state == gpumem_server::wire::JobState::Finished)
        .filter_map(|j| {
            let model = j
                .request
                .model
                .as_deref()
                .and_then(|m| ModelSpec::parse(m).ok())?;
            Some(Measurement {
                line: j.id as usize,
                label: format!("job {}", j.id),
                model: Some(ModelRef::Native(model)),
                batch: j.request.batch?,
                measured_bytes: j.peak_bytes.filter(|&p| p > 0)?,
                options: OptionOverrides::default(),
                published: Vec::new(),
            })
        })
        .collect();
    if rows.is_empty() {
        return Err(CliError::input(format!(
            "{}: no finished job has a native model spec and a measured peak",
            state.display()
        )));
    }
    Ok(rows)
}

pub fn calibrate(a: CalibrateArgs) -> CliResult {
    let profile = a.gpu.load()?;
    let (rows, source) = match (&a.measurements, &a.from_history) {
        (Some(p), None) => (read_csv(p)?, p.display().to_string()),
        (None, Some(dir)) => (history_rows(dir)?, format!("{} (history)", dir.display())),
        _ => {
            return Err(CliError::input(
                "give a measurements CSV or --from-history STATE_DIR",
            ));
        }
    };
    let defaults = a.workload.options()?;
    let mut runs = Vec::new();
    for m in &rows {
        match row_trace(m, &defaults, &profile)? {
            Ok(t) => runs.push((m, t)),
            Err(why) => eprintln!("skipped line {}: {why}", m.line),
        }
    }
    if runs.is_empty() {
        return Err(CliError::input(format!(
            "{source}: no row has a model gpumem can trace"
        )));
    }
    let bad_rows = || {
        CliError::input(format!(
            "--rows {}: expected all, first:N, smallest:N or lines:L1,L2,...",
            a.rows
        ))
    };
    let (rule, n) = match a.rows.split_once(':') {
        None if a.rows == "all" => ("all", runs.len()),
        Some(("lines", list)) => {
            let lines: Vec<usize> = list
                .split(',')
                .map(|l| l.trim().parse::<usize>())
                .collect::<Result<_, _>>()
                .map_err(|_| bad_rows())?;
            if let Some(l) = lines
                .iter()
                .find(|l| !runs.iter().any(|(m, _)| m.line == **l))
            {
                return Err(CliError::input(format!(
                    "--rows {}: line {l} is not a traced row of {source}",
                    a.rows
                )));
            }
            runs.retain(|(m, _)| lines.contains(&m.line));
            ("lines", runs.len())
        }
        Some((r @ ("first" | "smallest"), n)) => (
            r,
            n.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(bad_rows)?,
        ),
        _ => return Err(bad_rows()),
    };
    if rule == "smallest" {
        runs.sort_by_key(|(m, t)| (t.header.parameters.unwrap_or(u64::MAX), m.line));
    }
    runs.truncate(n);
    let fit_input: Vec<(Trace, u64)> = runs
        .iter()
        .map(|(m, t)| (t.clone(), m.measured_bytes))
        .collect();
    let cal = fit_context(&profile, &fit_input).map_err(CliError::input)?;
    println!(
        "fitted {} on {} rows ({}):",
        profile.name,
        cal.rows,
        if rule == "all" {
            "all".to_string()
        } else {
            a.rows.clone()
        }
    );
    println!(
        "  cuda_context_mib  {:.1}   (was {:.1})",
        cal.context_mib, profile.cuda_context_mib
    );
    println!("  bound_fixed_mib   {:.1}", cal.profile.bound_fixed_mib);
    println!("residuals (measured - fitted estimate):");
    for ((m, _), r) in runs.iter().zip(&cal.residuals_mib) {
        println!("  line {:>5}  {:>+8.1} MiB  {}", m.line, r, m.label);
    }
    let mut f =
        File::create(&a.out).map_err(|e| CliError::other(format!("{}: {e}", a.out.display())))?;
    f.write_all(cal.profile.to_toml().as_bytes())
        .map_err(|e| CliError::other(format!("{}: {e}", a.out.display())))?;
    println!("wrote {}", a.out.display());
    Ok(())
}
