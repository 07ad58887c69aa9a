//! Who is asking, and whose a job is.
//!
//! On the Unix socket a caller is who the kernel says it is (SO_PEERCRED), as the trusted local
//! schedulers do it; over TCP, where the kernel cannot say, the holder of the token is the
//! daemon's own user. A job belongs to the user who submitted it and runs as that user.

use nix::unistd::{Gid, Group, Uid, User as Passwd};

/// A user of the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
}

impl User {
    /// The user this process runs as.
    pub fn current() -> User {
        User {
            uid: Uid::current().as_raw(),
            gid: Gid::current().as_raw(),
        }
    }

    pub fn is_root(self) -> bool {
        self.uid == 0
    }

    /// The login name (the uid in decimal where the user database has none).
    pub fn name(self) -> String {
        Passwd::from_uid(Uid::from_raw(self.uid))
            .ok()
            .flatten()
            .map_or_else(|| self.uid.to_string(), |u| u.name)
    }

    /// HOME, USER and LOGNAME as a login would set them (what the user database has).
    pub fn login_env(self) -> Vec<(&'static str, String)> {
        let Some(u) = Passwd::from_uid(Uid::from_raw(self.uid)).ok().flatten() else {
            return Vec::new();
        };
        vec![
            ("HOME", u.dir.display().to_string()),
            ("USER", u.name.clone()),
            ("LOGNAME", u.name),
        ]
    }

    /// The user's groups: its primary one and every group the user database lists it in.
    pub fn groups(self) -> Vec<u32> {
        let mut groups = vec![self.gid];
        if let Some(u) = Passwd::from_uid(Uid::from_raw(self.uid)).ok().flatten()
            && let Ok(name) = std::ffi::CString::new(u.name)
            && let Ok(list) = nix::unistd::getgrouplist(&name, Gid::from_raw(self.gid))
        {
            groups.extend(list.into_iter().map(Gid::as_raw));
        }
        groups.sort_unstable();
        groups.dedup();
        groups
    }
}

/// Who sees and cancels every job: root, the daemon's own user and the members of the
/// configured admin group. Anyone else sees only their own jobs.
#[derive(Debug, Clone)]
pub struct Admins {
    pub daemon: User,
    pub group: Option<u32>,
}

impl Admins {
    pub fn contain(&self, u: User) -> bool {
        u.is_root()
            || u.uid == self.daemon.uid
            || self.group.is_some_and(|g| u.groups().contains(&g))
    }
}

/// The gid of the group named `name`, if the group database has it.
pub fn group_id(name: &str) -> Option<u32> {
    Group::from_name(name)
        .ok()
        .flatten()
        .map(|g| g.gid.as_raw())
}
