use super::*;
use crate::estimate::{Estimator, Replay};
use crate::profile::builtin;
use crate::rng::SplitMix64;
use crate::trace::Phase;

const PARAMS: [u64; 3] = [3 << 20, 1 << 20, 40 << 10];
/// Bytes of one layer's activation per token.
const PER_TOKEN: u64 = 8 << 10;

/// A training loop over sequence lengths, one iteration per entry, as the tracer records one:
/// the old batch dies as the new one arrives, zero_grad frees the gradients, the old loss dies
/// when the new one is bound, the first optimizer step makes its state. Its trace at `[L; 3]`
/// is shape L's; at any sequence, the run traced in order.
fn loop_trace(lengths: &[u64]) -> Trace {
    let mut b = TraceBuilder::new(TraceHeader::new("toy", 4));
    for &p in &PARAMS {
        b.alloc(p, Category::Parameter, Phase::Setup, "param");
    }
    let (mut batch, mut grads, mut loss): (Vec<u64>, Vec<u64>, Option<u64>) =
        (vec![], vec![], None);
    for (i, &len) in lengths.iter().enumerate() {
        for id in batch.drain(..) {
            b.free(id);
        }
        for _ in 0..2 {
            batch.push(b.alloc(len * 8, Category::InputBatch, Phase::Forward, "copy"));
        }
        for id in grads.drain(..) {
            b.free(id);
        }
        let mut acts = Vec::new();
        for layer in 0..3 {
            acts.push(b.alloc(
                len * PER_TOKEN * (layer + 1),
                Category::Activation,
                Phase::Forward,
                "mm",
            ));
            let t = b.alloc(
                len * PER_TOKEN / 2,
                Category::Temporary,
                Phase::Forward,
                "softmax",
            );
            b.op("mm", len * 1000, len * 10, len * 10);
            b.free(t);
        }
        let new_loss = b.alloc(4, Category::Activation, Phase::Forward, "loss");
        if let Some(old) = loss.replace(new_loss) {
            b.free(old);
        }
        for (k, act) in acts.into_iter().enumerate().rev() {
            let g = b.alloc(
                len * PER_TOKEN * (k as u64 + 1),
                Category::Temporary,
                Phase::Backward,
                "mm_bw",
            );
            b.free(act);
            b.free(g);
        }
        for &p in &PARAMS {
            grads.push(b.alloc(p, Category::Gradient, Phase::Backward, "grad"));
        }
        if i == 0 {
            for &p in &PARAMS {
                for _ in 0..2 {
                    b.alloc(p, Category::OptimizerState, Phase::Optimizer, "adam_state");
                }
            }
        }
        let t = b.alloc(PARAMS[0], Category::Temporary, Phase::Optimizer, "foreach");
        b.free(t);
        b.iteration_end();
    }
    b.finish()
}

fn reserved(trace: &Trace) -> u64 {
    let profile = builtin("a100-40gb").unwrap();
    Replay::default()
        .estimate(trace, &profile)
        .unwrap()
        .allocator
        .unwrap()
        .peak_reserved
}

/// The distinct lengths of `lengths`, their fixed-length traces, and each step's shape index.
fn shapes_of(lengths: &[u64]) -> (Vec<Trace>, Vec<usize>) {
    let mut distinct = lengths.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let traces = distinct.iter().map(|&l| loop_trace(&[l; 3])).collect();
    let order = lengths
        .iter()
        .map(|l| distinct.binary_search(l).unwrap())
        .collect();
    (traces, order)
}

fn spliced(lengths: &[u64]) -> Trace {
    let (traces, order) = shapes_of(lengths);
    let refs: Vec<&Trace> = traces.iter().collect();
    StepSequence::new(&refs, order)
        .unwrap()
        .splice(TraceHeader::new("toy", 4))
        .unwrap()
}

#[test]
fn a_spliced_run_is_the_loop_traced_in_that_order_event_for_event() {
    for lengths in [
        vec![512, 128, 2048, 128, 700, 700, 2048, 64],
        vec![64, 64, 64],
        vec![300],
        vec![2048, 64],
    ] {
        let want = loop_trace(&lengths);
        let got = spliced(&lengths);
        assert_eq!(got.events(), want.events(), "{lengths:?}");
        assert_eq!(got.op_names(), want.op_names());
        assert_eq!(got.header.iterations, lengths.len() as u32);
    }
}

#[test]
fn a_run_reserves_more_than_its_longest_step_and_its_any_order_bound_covers_every_order() {
    let profile = builtin("a100-40gb").unwrap();
    let mut rng = SplitMix64(33);
    let lengths: Vec<u64> = (0..40).map(|_| 128 + rng.next_u64() % 1921).collect();
    let (traces, _) = shapes_of(&lengths);
    let refs: Vec<&Trace> = traces.iter().collect();
    let longest = reserved(&loop_trace(&[*lengths.iter().max().unwrap(); 3]));
    let mut ascending = lengths.clone();
    ascending.sort_unstable();
    let mut descending = ascending.clone();
    descending.reverse();
    let mut orders = vec![lengths.clone(), ascending.clone(), descending];
    for _ in 0..40 {
        let mut o = lengths.clone();
        rng.shuffle(&mut o);
        orders.push(o);
    }
    let (_, order) = shapes_of(&lengths);
    let bound = StepSequence::new(&refs, order)
        .unwrap()
        .any_order_bound(&profile)
        .unwrap();
    assert_eq!(bound.shape_bytes.len(), traces.len());
    let mut most = 0;
    for o in &orders {
        let r = reserved(&spliced(o));
        assert_eq!(
            r,
            reserved(&loop_trace(o)),
            "the splice replays as the loop"
        );
        assert!(
            r <= bound.reserved_bytes,
            "{r} > bound {} for {o:?}",
            bound.reserved_bytes
        );
        most = most.max(r);
    }
    // Ascending is the classic creep: each longer step finds every cached block too small.
    let asc = reserved(&spliced(&ascending));
    assert!(
        asc > longest,
        "ascending run {asc} vs longest step {longest}"
    );
    assert!(most >= asc);
    // The bound is the persistent allocator plus each shape's own.
    assert_eq!(
        bound.reserved_bytes,
        bound.persistent_bytes + bound.shape_bytes.iter().sum::<u64>()
    );
}

#[test]
fn a_fixed_length_run_reserves_what_its_step_does() {
    // Steady steps: the run of one length creeps nowhere.
    let one = reserved(&loop_trace(&[1000; 3]));
    assert_eq!(reserved(&spliced(&[1000; 30])), one);
}

#[test]
fn steps_that_keep_different_tensors_are_refused() {
    let a = loop_trace(&[128; 3]);
    // A loop that keeps one more tensor across its steps.
    let mut b = TraceBuilder::new(TraceHeader::new("toy", 4));
    b.alloc(1, Category::Parameter, Phase::Setup, "param");
    for _ in 0..3 {
        b.alloc(1, Category::Activation, Phase::Forward, "kept");
        b.iteration_end();
    }
    let b = b.finish();
    let seq = StepSequence::new(&[&a, &b], vec![0, 1]).unwrap();
    let e = seq.splice(TraceHeader::new("toy", 4)).unwrap_err();
    assert!(matches!(e, RunError::Carried { step: 1, .. }), "{e}");
    let short = loop_trace(&[128; 2]);
    assert!(matches!(
        StepSequence::new(&[&short], vec![0]),
        Err(RunError::Iterations {
            shape: 0,
            iterations: 2
        })
    ));
    assert!(matches!(
        StepSequence::new(&[&a], vec![0, 1]),
        Err(RunError::NoShape { step: 1, .. })
    ));
}
