//! How collocated jobs slow each other down.
//!
//! [`Interference`] is the replaceable part: given the solo utilization of every job on one GPU,
//! it returns each job's speed relative to running alone. [`ProportionalSharing`] is the default:
//! - a GPU's pressure is the larger of its jobs' summed SMACT and summed DRAMA (time-sharing
//!   the SMs and the memory bus are the two ways training jobs contend);
//! - at pressure ≤ 1 every job runs at full speed (they fit in each other's idle time);
//! - above 1, every job runs at 1 / pressure (the scheduler shares the saturated resource in
//!   proportion to demand), but never below `floor` (context switching is not free, but a job
//!   always gets its time slice).
//!
//! Assumptions: utilization adds linearly; memory capacity does not slow anyone down (crashes are
//! modelled separately); no extra cost for the context switch itself below saturation.

use gpumem_place::Load;

/// Speeds of the jobs sharing one GPU.
pub trait Interference {
    /// `loads[i]` is job i's utilization alone; returns job i's relative speed in (0, 1].
    fn rates(&self, loads: &[Load]) -> Vec<f64>;
}

/// The default model (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProportionalSharing {
    pub floor: f64,
}

impl Default for ProportionalSharing {
    fn default() -> Self {
        ProportionalSharing { floor: 0.1 }
    }
}

impl Interference for ProportionalSharing {
    fn rates(&self, loads: &[Load]) -> Vec<f64> {
        let total = loads.iter().fold(Load::default(), |a, &l| a.plus(l));
        let rate = (1.0 / total.pressure().max(1.0)).max(self.floor);
        vec![rate; loads.len()]
    }
}

/// No interference at all (an upper bound on what collocation can gain).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NoInterference;

impl Interference for NoInterference {
    fn rates(&self, loads: &[Load]) -> Vec<f64> {
        vec![1.0; loads.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(smact: f64, dram: f64) -> Load {
        Load {
            smact,
            smocc: 0.0,
            dram,
        }
    }

    #[test]
    fn below_saturation_nobody_slows_down() {
        assert_eq!(
            ProportionalSharing::default().rates(&[l(0.4, 0.2), l(0.5, 0.3)]),
            vec![1.0, 1.0]
        );
    }

    #[test]
    fn above_saturation_jobs_share_in_proportion() {
        let r = ProportionalSharing::default().rates(&[l(0.8, 0.2), l(0.8, 0.1)]);
        assert!((r[0] - 1.0 / 1.6).abs() < 1e-12 && r[0] == r[1], "{r:?}");
        // Memory-bound jobs contend on DRAM even when SMs are free.
        let r = ProportionalSharing::default().rates(&[l(0.3, 0.9), l(0.3, 0.9)]);
        assert!((r[0] - 1.0 / 1.8).abs() < 1e-12, "{r:?}");
    }

    #[test]
    fn the_floor_holds() {
        let many = vec![l(0.9, 0.0); 20];
        assert!(
            ProportionalSharing { floor: 0.1 }
                .rates(&many)
                .iter()
                .all(|&r| r == 0.1)
        );
    }
}
