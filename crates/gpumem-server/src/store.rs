//! The job store: SQLite in WAL mode. Every state change is written before it takes effect, so a
//! restarted daemon knows every job and what it was doing.

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, params};

use crate::identity::User;
use crate::wire::{JobRequest, JobState};

/// A job as the daemon keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    pub id: u64,
    /// Who submitted it: the user it runs as, the only one (with the admins) who sees it.
    pub owner: User,
    pub request: JobRequest,
    pub state: JobState,
    pub assigned: Vec<u32>,
    pub estimate_bytes: Option<u64>,
    pub bound_bytes: Option<u64>,
    pub peak_bytes: Option<u64>,
    pub submitted_at: f64,
    pub started_at: Option<f64>,
    pub finished_at: Option<f64>,
    pub exit_code: Option<i32>,
    pub retries: u32,
    pub error: Option<String>,
    /// The supervisor's pid (and process group) of the current run.
    pub pid: Option<u32>,
    /// Cancellation was asked for while it ran.
    pub cancel_requested: bool,
}

impl JobRecord {
    /// A new submission waiting in the queue (its id comes from the store); `estimate` is
    /// (peak, bound) bytes per GPU.
    pub fn queued(
        owner: User,
        request: JobRequest,
        estimate: Option<(u64, u64)>,
        submitted_at: f64,
    ) -> JobRecord {
        JobRecord {
            id: 0,
            owner,
            request,
            state: JobState::Queued,
            assigned: Vec::new(),
            estimate_bytes: estimate.map(|e| e.0),
            bound_bytes: estimate.map(|e| e.1),
            peak_bytes: None,
            submitted_at,
            started_at: None,
            finished_at: None,
            exit_code: None,
            retries: 0,
            error: None,
            pid: None,
            cancel_requested: false,
        }
    }
}

/// One entry of a job's history: when it entered which state, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct StateChange {
    pub at: f64,
    pub state: JobState,
    pub note: Option<String>,
}

pub struct Store {
    conn: Connection,
    /// The next job's id: above every stored one and the floor (the daemon is the only writer).
    next_id: u64,
}

/// Why the job store could not be opened, read or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database file could not be opened.
    #[error("{file}: {source}")]
    Open {
        file: String,
        source: rusqlite::Error,
    },
    /// The database file could not be created or made private (0600).
    #[error("{file}: {source}")]
    Private {
        file: String,
        source: std::io::Error,
    },
    /// A statement failed.
    #[error("job store: {0}")]
    Sql(#[from] rusqlite::Error),
    /// A job's stored JSON column (`column`: request or assigned) does not read back.
    #[error("job store: job {job}: {source}")]
    Column {
        job: u64,
        column: &'static str,
        source: serde_json::Error,
    },
    #[error("job store: job {job}: unknown state `{state}`")]
    UnknownState { job: u64, state: String },
    /// The file is not a job store this gpumem can read: damaged, or not SQLite at all.
    #[error("{file} is damaged ({detail}); move it aside or start with --recover")]
    Damaged { file: String, detail: String },
    /// A store written by a newer gpumem.
    #[error(
        "{file} has job store version {found}; this gpumem reads version {known} (use the gpumem that wrote it)"
    )]
    Version {
        file: String,
        found: i64,
        known: i64,
    },
    /// A job's `field` could not be written as JSON.
    #[error("{source}")]
    Encode {
        field: &'static str,
        source: serde_json::Error,
    },
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY,
    request TEXT NOT NULL,
    state TEXT NOT NULL,
    assigned TEXT NOT NULL,
    estimate_bytes INTEGER,
    bound_bytes INTEGER,
    peak_bytes INTEGER,
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    exit_code INTEGER,
    retries INTEGER NOT NULL,
    error TEXT,
    pid INTEGER,
    cancel_requested INTEGER NOT NULL,
    owner_uid INTEGER,
    owner_gid INTEGER
);
CREATE TABLE IF NOT EXISTS events (
    job INTEGER NOT NULL,
    at REAL NOT NULL,
    state TEXT NOT NULL,
    note TEXT
);
CREATE INDEX IF NOT EXISTS events_job ON events(job);
";

/// The store's layout, in SQLite's `user_version` (0: a store from before versions, the layout
/// of 1). Version 2 adds the owner columns; a job of an older store is the daemon's user's.
const SCHEMA_VERSION: i64 = 2;

/// The files a store at `path` is made of: the database, its WAL and its shared-memory index.
pub fn files(path: &Path) -> [PathBuf; 3] {
    ["", "-wal", "-shm"].map(|ext| PathBuf::from(format!("{}{ext}", path.display())))
}

impl Store {
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        // Private to the daemon's user (requests hold commands and environments): made 0600
        // before SQLite opens it, whose WAL and shared-memory files take the database's mode.
        {
            use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
            let private = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(path)
                .and_then(|_| {
                    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                });
            private.map_err(|source| StoreError::Private {
                file: path.display().to_string(),
                source,
            })?;
        }
        let file = path.display().to_string();
        let conn = Connection::open(path).map_err(|source| StoreError::Open {
            file: file.clone(),
            source,
        })?;
        let damaged = |e: rusqlite::Error| StoreError::Damaged {
            file: file.clone(),
            detail: e.to_string().replace('\n', " "),
        };
        // WAL: readers never block the writer; NORMAL sync is durable across process crashes
        // (the case a daemon must survive) at a fraction of FULL's cost.
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(damaged)?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        let check: String = conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(damaged)?;
        if check != "ok" {
            return Err(StoreError::Damaged {
                file,
                detail: check.replace('\n', " "),
            });
        }
        let found: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if found > SCHEMA_VERSION {
            return Err(StoreError::Version {
                file,
                found,
                known: SCHEMA_VERSION,
            });
        }
        conn.execute_batch(SCHEMA).map_err(damaged)?;
        if found < 2 {
            let has_owner: bool = conn.query_row(
                "SELECT COUNT(*) FROM pragma_table_info('jobs') WHERE name = 'owner_uid'",
                [],
                |r| r.get(0),
            )?;
            if !has_owner {
                conn.execute_batch("ALTER TABLE jobs ADD COLUMN owner_uid INTEGER; ALTER TABLE jobs ADD COLUMN owner_gid INTEGER;")?;
            }
        }
        conn.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        let max: Option<i64> = conn.query_row("SELECT MAX(id) FROM jobs", [], |r| r.get(0))?;
        Ok(Store {
            conn,
            next_id: max.map_or(1, |m| m as u64 + 1),
        })
    }

    /// Copies what the WAL holds into the database file (a passive checkpoint: it waits for
    /// nobody). The daemon does this every second, so a lost WAL loses at most that second.
    pub fn checkpoint(&self) -> Result<(), StoreError> {
        self.conn
            .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))?;
        Ok(())
    }

    /// New jobs get ids above `floor` too: ids that job directories outside the store already
    /// have (a lost WAL's last jobs, a store set aside by --recover) are never given again.
    pub fn set_id_floor(&mut self, floor: u64) {
        self.next_id = self.next_id.max(floor + 1);
    }

    /// Stores a new job (as submitted: its request, state, sizes, owner and error) and returns
    /// its id.
    pub fn insert(&mut self, job: &JobRecord) -> Result<u64, StoreError> {
        let request = serde_json::to_string(&job.request).map_err(|source| StoreError::Encode {
            field: "request",
            source,
        })?;
        self.conn
            .execute(
                "INSERT INTO jobs (id, request, state, assigned, estimate_bytes, bound_bytes, submitted_at, retries, cancel_requested, owner_uid, owner_gid, error)
                 VALUES (?8, ?1, ?2, '[]', ?3, ?4, ?5, 0, 0, ?6, ?7, ?9)",
                params![request, job.state.name(), job.estimate_bytes.map(|b| b as i64), job.bound_bytes.map(|b| b as i64), job.submitted_at, job.owner.uid, job.owner.gid, self.next_id as i64, job.error],
            )?;
        let id = self.next_id;
        self.next_id += 1;
        self.event(id, job.submitted_at, job.state, None)?;
        Ok(id)
    }

    /// Writes a job's mutable fields.
    pub fn update(&mut self, job: &JobRecord) -> Result<(), StoreError> {
        update(&self.conn, job)
    }

    /// Writes a job and records its transition, atomically.
    pub fn transition(
        &mut self,
        job: &JobRecord,
        at: f64,
        note: Option<&str>,
    ) -> Result<(), StoreError> {
        let tx = self.conn.transaction()?;
        update(&tx, job)?;
        event(&tx, job.id, at, job.state, note)?;
        Ok(tx.commit()?)
    }

    fn event(
        &mut self,
        job: u64,
        at: f64,
        state: JobState,
        note: Option<&str>,
    ) -> Result<(), StoreError> {
        event(&self.conn, job, at, state, note)
    }

    /// Every job, oldest first.
    pub fn load(&self) -> Result<Vec<JobRecord>, StoreError> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT id, request, state, assigned, estimate_bytes, bound_bytes, peak_bytes, submitted_at, started_at, finished_at,
                 exit_code, retries, error, pid, cancel_requested, owner_uid, owner_gid FROM jobs ORDER BY id",
            )?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, Option<i64>>(4)?,
                r.get::<_, Option<i64>>(5)?,
                r.get::<_, Option<i64>>(6)?,
                r.get::<_, f64>(7)?,
                r.get::<_, Option<f64>>(8)?,
                r.get::<_, Option<f64>>(9)?,
                r.get::<_, Option<i32>>(10)?,
                r.get::<_, u32>(11)?,
                r.get::<_, Option<String>>(12)?,
                r.get::<_, Option<u32>>(13)?,
                r.get::<_, bool>(14)?,
                r.get::<_, Option<u32>>(15)?
                    .zip(r.get::<_, Option<u32>>(16)?),
            ))
        })?;
        rows.map(|row| {
            let (
                id,
                request,
                state,
                assigned,
                est,
                bound,
                peak,
                sub,
                start,
                fin,
                code,
                retries,
                error,
                pid,
                cancel,
                owner,
            ) = row?;
            let job = id as u64;
            Ok(JobRecord {
                id: job,
                owner: owner.map_or_else(User::current, |(uid, gid)| User { uid, gid }),
                request: serde_json::from_str(&request).map_err(|source| StoreError::Column {
                    job,
                    column: "request",
                    source,
                })?,
                state: JobState::parse(&state).ok_or_else(|| StoreError::UnknownState {
                    job,
                    state: state.clone(),
                })?,
                assigned: serde_json::from_str(&assigned).map_err(|source| StoreError::Column {
                    job,
                    column: "assigned",
                    source,
                })?,
                estimate_bytes: est.map(|b| b as u64),
                bound_bytes: bound.map(|b| b as u64),
                peak_bytes: peak.map(|b| b as u64),
                submitted_at: sub,
                started_at: start,
                finished_at: fin,
                exit_code: code,
                retries,
                error,
                pid,
                cancel_requested: cancel,
            })
        })
        .collect()
    }

    /// The states a job went through, with notes.
    pub fn history(&self, job: u64) -> Result<Vec<StateChange>, StoreError> {
        let mut stmt = self
            .conn
            .prepare("SELECT at, state, note FROM events WHERE job = ?1 ORDER BY rowid")?;
        let rows = stmt.query_map([job as i64], |r| {
            Ok((
                r.get::<_, f64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<String>>(2)?,
            ))
        })?;
        rows.map(|row| {
            let (at, state, note) = row?;
            let state = JobState::parse(&state).ok_or_else(|| StoreError::UnknownState {
                job,
                state: state.clone(),
            })?;
            Ok(StateChange { at, state, note })
        })
        .collect()
    }

    pub fn exists(&self, job: u64) -> Result<bool, StoreError> {
        Ok(self
            .conn
            .query_row("SELECT 1 FROM jobs WHERE id = ?1", [job as i64], |_| Ok(()))
            .optional()?
            .is_some())
    }
}

fn update(conn: &Connection, job: &JobRecord) -> Result<(), StoreError> {
    let assigned = serde_json::to_string(&job.assigned).map_err(|source| StoreError::Encode {
        field: "assigned",
        source,
    })?;
    conn.execute(
        "UPDATE jobs SET state = ?2, assigned = ?3, peak_bytes = ?4, started_at = ?5, finished_at = ?6, exit_code = ?7,
         retries = ?8, error = ?9, pid = ?10, cancel_requested = ?11, estimate_bytes = ?12, bound_bytes = ?13 WHERE id = ?1",
        params![
            job.id as i64,
            job.state.name(),
            assigned,
            job.peak_bytes.map(|b| b as i64),
            job.started_at,
            job.finished_at,
            job.exit_code,
            job.retries,
            job.error,
            job.pid,
            job.cancel_requested,
            job.estimate_bytes.map(|b| b as i64),
            job.bound_bytes.map(|b| b as i64)
        ],
    )?;
    Ok(())
}

fn event(
    conn: &Connection,
    job: u64,
    at: f64,
    state: JobState,
    note: Option<&str>,
) -> Result<(), StoreError> {
    conn.execute(
        "INSERT INTO events (job, at, state, note) VALUES (?1, ?2, ?3, ?4)",
        params![job as i64, at, state.name(), note],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remove(path: &Path) {
        for f in files(path) {
            let _ = std::fs::remove_file(f);
        }
    }

    fn job() -> JobRecord {
        JobRecord::queued(
            User {
                uid: 1000,
                gid: 1000,
            },
            serde_json::from_str(r#"{"command": ["true"]}"#).unwrap(),
            Some((5 << 30, 6 << 30)),
            1.0,
        )
    }

    #[test]
    fn jobs_survive_reopening() {
        let path = std::env::temp_dir().join(format!("gpumem-store-{}.db", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut s = Store::open(&path).unwrap();
        let mut j = job();
        j.id = s.insert(&j).unwrap();
        j.state = JobState::Running;
        j.assigned = vec![2, 3];
        j.pid = Some(4242);
        j.started_at = Some(2.0);
        s.transition(&j, 2.0, Some("placed")).unwrap();
        drop(s);
        let s = Store::open(&path).unwrap();
        assert_eq!(s.load().unwrap(), vec![j.clone()]);
        let h = s.history(j.id).unwrap();
        assert_eq!(
            h.iter().map(|e| e.state).collect::<Vec<_>>(),
            [JobState::Queued, JobState::Running]
        );
        assert_eq!(h[1].note.as_deref(), Some("placed"));
        assert!(s.exists(j.id).unwrap() && !s.exists(99).unwrap());
        remove(&path);
    }

    #[test]
    fn a_damaged_or_newer_store_is_refused_in_one_line() {
        let path =
            std::env::temp_dir().join(format!("gpumem-store-refused-{}.db", std::process::id()));
        let clean = || remove(&path);
        clean();
        std::fs::write(&path, vec![0x5a; 8192]).unwrap();
        let e = Store::open(&path).err().expect("garbage is refused");
        assert!(
            matches!(e, StoreError::Damaged { .. })
                && e.to_string()
                    .ends_with("move it aside or start with --recover")
                && !e.to_string().contains('\n'),
            "{e}"
        );
        clean();
        let s = Store::open(&path).unwrap();
        s.conn.pragma_update(None, "user_version", 7).unwrap();
        drop(s);
        let e = Store::open(&path).err().expect("a newer store is refused");
        assert_eq!(
            e.to_string(),
            format!(
                "{} has job store version 7; this gpumem reads version 2 (use the gpumem that wrote it)",
                path.display()
            )
        );
        clean();
    }

    /// A version-1 store (no owners) opens, its jobs the daemon's user's.
    #[test]
    fn a_store_from_before_owners_is_upgraded() {
        let path = std::env::temp_dir().join(format!("gpumem-store-v1-{}.db", std::process::id()));
        remove(&path);
        let v1 = SCHEMA.replace(",\n    owner_uid INTEGER,\n    owner_gid INTEGER", "");
        assert!(!v1.contains("owner"));
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(&v1).unwrap();
        conn.execute("INSERT INTO jobs (request, state, assigned, submitted_at, retries, cancel_requested) VALUES ('{\"command\": [\"true\"]}', 'queued', '[]', 1.0, 0, 0)", []).unwrap();
        conn.pragma_update(None, "user_version", 1).unwrap();
        drop(conn);
        let s = Store::open(&path).unwrap();
        assert_eq!(s.load().unwrap()[0].owner, User::current());
        let version: i64 = s
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        remove(&path);
    }

    /// After a checkpoint the database file holds every job: a lost WAL loses nothing older.
    #[test]
    fn a_checkpointed_store_survives_its_wal() {
        let path = std::env::temp_dir().join(format!("gpumem-store-wal-{}.db", std::process::id()));
        let clean = || remove(&path);
        clean();
        let mut s = Store::open(&path).unwrap();
        let ids: Vec<u64> = (0..50).map(|_| s.insert(&job()).unwrap()).collect();
        s.checkpoint().unwrap();
        // The WAL and its index vanish as the process dies (copied aside first: SQLite removes
        // an intact WAL when it closes).
        let db = std::fs::read(&path).unwrap();
        std::mem::forget(s);
        clean();
        std::fs::write(&path, db).unwrap();
        let s = Store::open(&path).unwrap();
        assert_eq!(
            s.load().unwrap().iter().map(|j| j.id).collect::<Vec<_>>(),
            ids
        );
        drop(s);
        clean();
    }

    #[test]
    fn damaged_rows_name_the_job() {
        let path =
            std::env::temp_dir().join(format!("gpumem-store-damaged-{}.db", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut s = Store::open(&path).unwrap();
        let id = s.insert(&job()).unwrap();
        s.conn
            .execute("UPDATE jobs SET state = 'lost'", [])
            .unwrap();
        let e = s.load().unwrap_err();
        assert!(matches!(&e, StoreError::UnknownState { job, .. } if *job == id));
        assert_eq!(
            e.to_string(),
            format!("job store: job {id}: unknown state `lost`")
        );
        s.conn
            .execute("UPDATE jobs SET state = 'queued', assigned = 'nope'", [])
            .unwrap();
        let e = s.load().unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::Column {
                    column: "assigned",
                    ..
                }
            ) && e.to_string().starts_with(&format!("job store: job {id}: ")),
            "{e}"
        );
        drop(s);
        remove(&path);
        let dir = std::env::temp_dir();
        let e = Store::open(&dir).map(|_| ()).unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::Open { .. } | StoreError::Private { .. } | StoreError::Sql(_)
            ),
            "{e}"
        );
    }
}
