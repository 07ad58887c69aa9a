//! Sequence lengths that vary by step: most fine-tuning pads each batch to its longest sample,
//! so every step has a length of its own. A [`LengthSchedule`] states where the lengths come
//! from (a range, or a dataset's token-length histogram), the padding multiple, how many steps
//! and the seed; [`LengthSchedule::draw`] gives the same lengths for the same schedule on every
//! machine and version (SplitMix64).

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::rng::SplitMix64;

/// Steps drawn when a schedule states none.
pub const DEFAULT_STEPS: u32 = 100;
/// Most steps a schedule may draw (each is replayed).
pub const MAX_STEPS: u32 = 100_000;
/// Most distinct lengths a histogram may list.
pub const MAX_HISTOGRAM: usize = 1 << 20;

/// Where a schedule's token lengths come from, before padding.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LengthSource {
    /// Uniform over `min..=max`.
    Range { min: u64, max: u64 },
    /// Lengths weighted by their counts (a dataset's token-length histogram). Invariant:
    /// lengths positive, strictly increasing, each count positive, at least one entry.
    Histogram(Vec<(u64, u64)>),
}

/// A seeded sequence of per-step sequence lengths. Invariant (made only through
/// [`LengthSchedule::new`] or serde's check): a valid source, `pad_to` ≥ 1, `steps` in
/// 1..=[`MAX_STEPS`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "LengthScheduleDoc", into = "LengthScheduleDoc")]
pub struct LengthSchedule {
    source: LengthSource,
    /// Each drawn length rounded up to a multiple of this (Hugging Face's `pad_to_multiple_of`).
    pad_to: u64,
    steps: u32,
    seed: u64,
}

/// What a schedule's sizes size: each step's sequence length (`seq_lens`), or the side of
/// each step's square images (`image_sides`: multi-scale training, YOLO's `multi_scale`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StepAxis {
    SeqLen,
    ImageSide,
}

impl StepAxis {
    /// The options' field that holds such a schedule, and its flag.
    pub fn field(self) -> &'static str {
        match self {
            StepAxis::SeqLen => "seq_lens (--seq-len MIN..MAX)",
            StepAxis::ImageSide => "image_sides (--input CxMIN..MAX)",
        }
    }
}

/// A schedule refused, naming the field (and the flag) that is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LengthError {
    #[error("seq_len range (--seq-len MIN..MAX) `{0}`: expected two positive integers MIN..MAX")]
    RangeText(String),
    #[error("seq_len range (--seq-len) {min}..{max}: MIN must be at least 1 and at most MAX")]
    Range { min: u64, max: u64 },
    #[error("seq_lens.steps (--steps) {0} is out of range (1..={MAX_STEPS})")]
    Steps(u32),
    #[error("seq_lens.pad_to (--pad-to-multiple-of) must be at least 1")]
    PadTo,
    #[error("seq_lens states {0}: give either min and max, or a histogram")]
    Source(&'static str),
    #[error("seq_lens histogram (--seq-len-histogram) line {line}: {what}")]
    Histogram { line: usize, what: String },
    #[error("seq_lens histogram (--seq-len-histogram) has no lengths")]
    EmptyHistogram,
}

impl LengthSchedule {
    pub fn new(
        source: LengthSource,
        pad_to: u64,
        steps: u32,
        seed: u64,
    ) -> Result<LengthSchedule, LengthError> {
        match &source {
            LengthSource::Range { min, max } if *min == 0 || min > max => {
                return Err(LengthError::Range {
                    min: *min,
                    max: *max,
                });
            }
            LengthSource::Histogram(h) => {
                if h.is_empty() {
                    return Err(LengthError::EmptyHistogram);
                }
                for (i, &(len, count)) in h.iter().enumerate() {
                    let bad = |what: String| LengthError::Histogram { line: i + 1, what };
                    if len == 0 || count == 0 {
                        return Err(bad(format!(
                            "length {len}, count {count}: both must be at least 1"
                        )));
                    }
                    if i > 0 && h[i - 1].0 >= len {
                        return Err(bad(format!("length {len} is not above the line before")));
                    }
                }
                if h.len() > MAX_HISTOGRAM {
                    return Err(LengthError::Histogram {
                        line: MAX_HISTOGRAM + 1,
                        what: format!("more than {MAX_HISTOGRAM} lengths"),
                    });
                }
            }
            LengthSource::Range { .. } => {}
        }
        if pad_to == 0 {
            return Err(LengthError::PadTo);
        }
        if steps == 0 || steps > MAX_STEPS {
            return Err(LengthError::Steps(steps));
        }
        Ok(LengthSchedule {
            source,
            pad_to,
            steps,
            seed,
        })
    }

    /// `MIN..MAX` as the command line states a range.
    pub fn parse_range(text: &str) -> Result<LengthSource, LengthError> {
        let bad = || LengthError::RangeText(text.to_string());
        let (a, b) = text.split_once("..").ok_or_else(bad)?;
        let min = a.trim().parse::<u64>().map_err(|_| bad())?;
        let max = b.trim().parse::<u64>().map_err(|_| bad())?;
        if min == 0 || min > max {
            return Err(LengthError::Range { min, max });
        }
        Ok(LengthSource::Range { min, max })
    }

    /// A token-length histogram as CSV text: `length,count` per line (a header line whose
    /// fields are not numbers, blank lines and `#` comments are skipped; lengths in any order,
    /// repeated lengths added up).
    pub fn parse_histogram(text: &str) -> Result<LengthSource, LengthError> {
        let mut counts = std::collections::BTreeMap::<u64, u64>::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |what: &str| LengthError::Histogram {
                line: i + 1,
                what: format!("`{line}`: {what}"),
            };
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let [len, count] = fields[..] else {
                return Err(bad("expected length,count"));
            };
            let (Ok(len), Ok(count)) = (len.parse::<u64>(), count.parse::<u64>()) else {
                if i == 0 || counts.is_empty() && len.parse::<u64>().is_err() {
                    continue; // a header line
                }
                return Err(bad("length and count must be whole numbers"));
            };
            if len == 0 || count == 0 {
                return Err(bad("length and count must be at least 1"));
            }
            let c = counts.entry(len).or_default();
            *c = c
                .checked_add(count)
                .ok_or_else(|| bad("counts add up past 2^64"))?;
        }
        Ok(LengthSource::Histogram(counts.into_iter().collect()))
    }

    pub fn source(&self) -> &LengthSource {
        &self.source
    }
    pub fn pad_to(&self) -> u64 {
        self.pad_to
    }
    pub fn steps(&self) -> u32 {
        self.steps
    }
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The schedule's lengths, one per step, padded: the same for the same schedule, always.
    pub fn draw(&self) -> Vec<u64> {
        let mut rng = SplitMix64(self.seed);
        let total = match &self.source {
            LengthSource::Histogram(h) => h.iter().map(|&(_, c)| u128::from(c)).sum::<u128>(),
            LengthSource::Range { .. } => 0,
        };
        (0..self.steps)
            .map(|_| {
                let len = match &self.source {
                    // Modulo: its bias is below 2^-40 for any range a sequence has.
                    LengthSource::Range { min, max } => min + rng.next_u64() % (max - min + 1),
                    LengthSource::Histogram(h) => {
                        let mut r = u128::from(rng.next_u64()) % total;
                        let mut pick = h[h.len() - 1].0;
                        for &(len, count) in h {
                            if r < u128::from(count) {
                                pick = len;
                                break;
                            }
                            r -= u128::from(count);
                        }
                        pick
                    }
                };
                len.div_ceil(self.pad_to) * self.pad_to
            })
            .collect()
    }
}

impl fmt::Display for LengthSchedule {
    /// `uniform 128..2048, padded to 64, 100 steps, seed 0` — what the output states.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            LengthSource::Range { min, max } => write!(f, "uniform {min}..{max}")?,
            LengthSource::Histogram(h) => write!(
                f,
                "histogram of {} lengths ({}..{})",
                h.len(),
                h[0].0,
                h[h.len() - 1].0
            )?,
        }
        if self.pad_to > 1 {
            write!(f, ", padded to a multiple of {}", self.pad_to)?;
        }
        write!(f, ", {} steps, seed {}", self.steps, self.seed)
    }
}

fn default_steps() -> u32 {
    DEFAULT_STEPS
}
fn one() -> u64 {
    1
}
fn is_one(n: &u64) -> bool {
    *n == 1
}

/// A schedule as job files and JSON state it: `{min, max}` or `{histogram: [[length, count],
/// …]}`, with `pad_to`, `steps` and `seed`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LengthScheduleDoc {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<u64>,
    /// `[length, count]` pairs, lengths increasing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub histogram: Option<Vec<(u64, u64)>>,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub pad_to: u64,
    #[serde(default = "default_steps")]
    pub steps: u32,
    #[serde(default)]
    pub seed: u64,
}

impl TryFrom<LengthScheduleDoc> for LengthSchedule {
    type Error = LengthError;

    fn try_from(d: LengthScheduleDoc) -> Result<LengthSchedule, LengthError> {
        let source = match (d.min, d.max, d.histogram) {
            (Some(min), Some(max), None) => LengthSource::Range { min, max },
            (None, None, Some(h)) => LengthSource::Histogram(h),
            (None, None, None) => return Err(LengthError::Source("no lengths")),
            (_, _, Some(_)) => return Err(LengthError::Source("a range and a histogram")),
            _ => return Err(LengthError::Source("only one of min and max")),
        };
        LengthSchedule::new(source, d.pad_to, d.steps, d.seed)
    }
}

impl From<LengthSchedule> for LengthScheduleDoc {
    fn from(s: LengthSchedule) -> LengthScheduleDoc {
        let (min, max, histogram) = match s.source {
            LengthSource::Range { min, max } => (Some(min), Some(max), None),
            LengthSource::Histogram(h) => (None, None, Some(h)),
        };
        LengthScheduleDoc {
            min,
            max,
            histogram,
            pad_to: s.pad_to,
            steps: s.steps,
            seed: s.seed,
        }
    }
}

impl JsonSchema for LengthSchedule {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        LengthScheduleDoc::schema_name()
    }

    fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        LengthScheduleDoc::json_schema(g)
    }
}

/// What a run's lengths were, as the output states them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LengthSummary {
    /// What the sizes are.
    pub axis: StepAxis,
    /// The schedule, in words.
    pub distribution: String,
    pub steps: u32,
    pub seed: u64,
    pub min: u64,
    pub max: u64,
    /// Distinct lengths among the steps.
    pub distinct: usize,
}

impl LengthSchedule {
    /// The summary of `lengths` drawn from this schedule.
    pub fn summary(&self, lengths: &[u64], axis: StepAxis) -> LengthSummary {
        let mut distinct = lengths.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        LengthSummary {
            axis,
            distribution: self.to_string(),
            steps: self.steps,
            seed: self.seed,
            min: distinct.first().copied().unwrap_or(0),
            max: distinct.last().copied().unwrap_or(0),
            distinct: distinct.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(min: u64, max: u64, pad: u64, steps: u32, seed: u64) -> LengthSchedule {
        LengthSchedule::new(LengthSource::Range { min, max }, pad, steps, seed).unwrap()
    }

    #[test]
    fn a_range_draws_within_it_the_same_for_the_same_seed() {
        let a = range(128, 2048, 1, 500, 7).draw();
        assert_eq!(a.len(), 500);
        assert!(a.iter().all(|&l| (128..=2048).contains(&l)));
        assert_eq!(a, range(128, 2048, 1, 500, 7).draw());
        assert_ne!(a, range(128, 2048, 1, 500, 8).draw());
        // Uniform enough to reach both halves.
        assert!(a.iter().any(|&l| l < 600) && a.iter().any(|&l| l > 1600));
    }

    #[test]
    fn padding_rounds_each_length_up_to_its_multiple() {
        let a = range(100, 300, 64, 200, 1).draw();
        assert!(a.iter().all(|&l| l % 64 == 0 && (128..=320).contains(&l)));
        let mut d = a.clone();
        d.sort_unstable();
        d.dedup();
        assert_eq!(d, vec![128, 192, 256, 320]);
    }

    #[test]
    fn a_histogram_draws_its_lengths_by_their_counts() {
        let src = LengthSchedule::parse_histogram("length,count\n512,1\n64,9\n\n# c\n64,0").err();
        assert!(
            matches!(src, Some(LengthError::Histogram { line: 6, .. })),
            "{src:?}"
        );
        let src = LengthSchedule::parse_histogram("length,count\n512,1\n64,9\n").unwrap();
        assert_eq!(src, LengthSource::Histogram(vec![(64, 9), (512, 1)]));
        let s = LengthSchedule::new(src, 1, 10_000, 3).unwrap();
        let a = s.draw();
        let long = a.iter().filter(|&&l| l == 512).count();
        assert!(a.iter().all(|&l| l == 64 || l == 512));
        assert!((700..1300).contains(&long), "{long} of 10000 at weight 0.1");
        let sum = s.summary(&a, StepAxis::SeqLen);
        assert_eq!(
            (sum.min, sum.max, sum.distinct, sum.steps),
            (64, 512, 2, 10_000)
        );
    }

    #[test]
    fn bad_schedules_are_refused_naming_what_is_wrong() {
        assert!(matches!(
            LengthSchedule::parse_range("2048..128"),
            Err(LengthError::Range {
                min: 2048,
                max: 128
            })
        ));
        assert!(matches!(
            LengthSchedule::parse_range("0..12"),
            Err(LengthError::Range { .. })
        ));
        assert!(LengthSchedule::parse_range("12-40").is_err());
        let r = LengthSource::Range { min: 1, max: 2 };
        assert_eq!(
            LengthSchedule::new(r.clone(), 1, 0, 0),
            Err(LengthError::Steps(0))
        );
        assert_eq!(LengthSchedule::new(r, 0, 5, 0), Err(LengthError::PadTo));
        assert_eq!(
            LengthSchedule::parse_histogram("a,b\n"),
            Ok(LengthSource::Histogram(vec![]))
        );
        assert_eq!(
            LengthSchedule::new(LengthSource::Histogram(vec![]), 1, 5, 0),
            Err(LengthError::EmptyHistogram)
        );
        assert!(LengthSchedule::parse_histogram("64,3\n12,x\n").is_err());
        assert!(LengthSchedule::parse_histogram("64,3,4\n").is_err());
        let e = serde_json::from_str::<LengthSchedule>(r#"{"min": 5}"#).unwrap_err();
        assert!(e.to_string().contains("only one of min and max"), "{e}");
        let e = serde_json::from_str::<LengthSchedule>(r#"{"histogram": [[8, 1], [4, 1]]}"#)
            .unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
    }

    #[test]
    fn a_schedule_reads_back_as_written() {
        let s = range(128, 2048, 8, 40, 9);
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(
            json,
            r#"{"min":128,"max":2048,"pad_to":8,"steps":40,"seed":9}"#
        );
        assert_eq!(serde_json::from_str::<LengthSchedule>(&json).unwrap(), s);
        let d: LengthSchedule = serde_json::from_str(r#"{"min": 1, "max": 4}"#).unwrap();
        assert_eq!((d.steps(), d.seed(), d.pad_to()), (DEFAULT_STEPS, 0, 1));
        assert_eq!(
            d.to_string(),
            format!("uniform 1..4, {DEFAULT_STEPS} steps, seed 0")
        );
    }
}
