//! The trace cache's size bound. Traces are kept until the cache holds more than its budget;
//! then the least recently used are removed (a hit renews an entry's modification time), down
//! to nine tenths of the budget so that the next write does not evict again.
//!
//! Nothing used or written within [`GRACE`] is removed: one estimate may write many traces
//! before it reads them (a run of varying lengths, a plan's search), and other processes share
//! the directory. A file the tracer is still writing, or one a run that died left behind, is
//! not an entry; it is removed once [`STALE`] has passed. An entry removed while another
//! process wants it costs that process a trace, never a wrong answer: entries are only ever
//! renamed into place whole.

use std::fs;
use std::path::Path;
use std::time::{Duration, SystemTime};

/// The default budget: many models' traces at several batch sizes, or one large varying-length
/// run's (a 34B model's 64-length estimate writes about 8 GB).
pub const DEFAULT_MAX_BYTES: u64 = 16 << 30;

/// How long a written or used entry is kept whatever the budget.
pub const GRACE: Duration = Duration::from_secs(30 * 60);

/// How long an unfinished file (a tracer's output being written, a run's scratch files) is
/// left alone before it is taken for a dead run's leftover.
pub const STALE: Duration = Duration::from_secs(24 * 3600);

/// What one [`evict`] removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Evicted {
    pub files: u64,
    pub bytes: u64,
}

/// A finished cache entry (`KEY.jsonl`, `KEY.sym.json`, KEY 16 hex digits), as opposed to
/// temporary and scratch files.
fn is_entry(name: &str) -> bool {
    let key = name
        .strip_suffix(".jsonl")
        .or_else(|| name.strip_suffix(".sym.json"));
    key.is_some_and(|k| k.len() == 16 && k.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Marks `path` as used now, so that eviction keeps it longer than entries not used since.
pub fn touch(path: &Path) {
    if let Ok(f) = fs::File::options().append(true).open(path) {
        let _ = f.set_modified(SystemTime::now());
    }
}

/// Removes the least recently used entries of `dir` while it holds more than `max_bytes`, and
/// any unfinished file older than [`STALE`]. Errors (a file another process removed first, a
/// directory not there) remove nothing and are not reported: the cache is a cache.
pub fn evict(dir: &Path, max_bytes: u64, now: SystemTime) -> Evicted {
    let Ok(read) = fs::read_dir(dir) else {
        return Evicted::default();
    };
    let age = |m: SystemTime| now.duration_since(m).unwrap_or(Duration::ZERO);
    let mut total = 0u64;
    let mut entries = Vec::new();
    let mut evicted = Evicted::default();
    for e in read.flatten() {
        let Ok(meta) = e.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let modified = meta.modified().unwrap_or(now);
        let name = e.file_name();
        if !is_entry(&name.to_string_lossy()) {
            if age(modified) > STALE && fs::remove_file(e.path()).is_ok() {
                evicted.files += 1;
                evicted.bytes += meta.len();
            }
            continue;
        }
        total += meta.len();
        if age(modified) > GRACE {
            entries.push((modified, meta.len(), e.path()));
        }
    }
    if total <= max_bytes {
        return evicted;
    }
    let low_water = max_bytes / 10 * 9;
    entries.sort_by_key(|&(modified, _, _)| modified);
    for (_, len, path) in entries {
        if total <= low_water {
            break;
        }
        if fs::remove_file(&path).is_ok() {
            total -= len;
            evicted.files += 1;
            evicted.bytes += len;
        }
    }
    evicted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &Path, name: &str, bytes: usize, age: Duration, now: SystemTime) {
        let path = dir.join(name);
        fs::write(&path, vec![b'x'; bytes]).unwrap();
        let f = fs::File::options().append(true).open(&path).unwrap();
        f.set_modified(now - age).unwrap();
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn scratch(test: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("gpumem-cache-{test}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn the_least_recently_used_entries_go_first_down_to_nine_tenths_of_the_budget() {
        let dir = scratch("lru");
        let now = SystemTime::now();
        file(&dir, "000000000000000a.jsonl", 400, 5 * HOUR, now);
        file(&dir, "000000000000000b.sym.json", 300, 4 * HOUR, now);
        file(&dir, "000000000000000c.jsonl", 300, 3 * HOUR, now);
        file(&dir, "000000000000000d.jsonl", 300, 2 * HOUR, now);
        // 1300 bytes against 1000: the oldest (400) leaves 900, nine tenths, and is enough.
        let out = evict(&dir, 1000, now);
        assert_eq!(
            out,
            Evicted {
                files: 1,
                bytes: 400
            }
        );
        assert_eq!(
            names(&dir),
            [
                "000000000000000b.sym.json",
                "000000000000000c.jsonl",
                "000000000000000d.jsonl"
            ]
        );
        // Within the budget, nothing more goes.
        assert_eq!(evict(&dir, 1000, now), Evicted::default());
        // A touched entry is the most recent: the next oldest goes instead.
        touch(&dir.join("000000000000000b.sym.json"));
        evict(&dir, 700, SystemTime::now() + 2 * GRACE);
        assert_eq!(
            names(&dir),
            ["000000000000000b.sym.json", "000000000000000d.jsonl"]
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn entries_within_the_grace_window_and_unfinished_files_stay_over_budget() {
        let dir = scratch("grace");
        let now = SystemTime::now();
        file(&dir, "000000000000000a.jsonl", 500, GRACE / 2, now);
        file(&dir, "000000000000000b.jsonl.tmp17-3", 500, HOUR, now);
        file(&dir, "tracer.tmp17-4.log", 500, HOUR, now);
        file(&dir, "000000000000000c.jsonl", 500, 2 * GRACE, now);
        let out = evict(&dir, 100, now);
        assert_eq!(
            out,
            Evicted {
                files: 1,
                bytes: 500
            }
        );
        assert_eq!(
            names(&dir),
            [
                "000000000000000a.jsonl",
                "000000000000000b.jsonl.tmp17-3",
                "tracer.tmp17-4.log"
            ]
        );
        // A day later the unfinished files are a dead run's leftovers, whatever the budget.
        let out = evict(&dir, u64::MAX, now + STALE + HOUR);
        assert_eq!(
            out,
            Evicted {
                files: 2,
                bytes: 1000
            }
        );
        assert_eq!(names(&dir), ["000000000000000a.jsonl"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_directory_evicts_nothing() {
        let dir = std::env::temp_dir().join("gpumem-cache-never-made");
        assert_eq!(evict(&dir, 0, SystemTime::now()), Evicted::default());
    }
}
