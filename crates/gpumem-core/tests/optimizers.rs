//! The native families' optimizer step (`step::optimizer`) against what the real optimizers
//! allocate: `tests/data/optimizer-steps.json`, recorded event by event on meta tensors from
//! torch, bitsandbytes and torchao by `python/tests/optimizer_steps.py` (the command is in the
//! file). Every allocation (bytes, and whether the step keeps it as state, host-backed state or
//! frees it) and every free, in order, for two steps of each optimizer the families model.

use gpumem_core::job::Optimizer;
use gpumem_core::step::{Param, StepEvent, TorchBehaviour, native, step_events};
use serde_json::{Value, json};

fn fixture() -> Value {
    serde_json::from_str(include_str!("data/optimizer-steps.json")).unwrap()
}

fn ours(optimizer: Optimizer, params: &[Param], first: bool) -> Vec<Value> {
    step_events(optimizer, TorchBehaviour::V2_1, params, first)
        .into_iter()
        .map(|e| match e {
            StepEvent::Alloc {
                bytes, category, ..
            } => json!(["alloc", bytes, category.name()]),
            StepEvent::Free(k) => json!(["free", k]),
        })
        .collect()
}

#[test]
fn every_native_optimizer_allocates_what_the_real_one_does() {
    let f = fixture();
    let params: Vec<Param> = f["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| Param {
            numel: p["numel"].as_u64().unwrap(),
            elem_bytes: 4,
        })
        .collect();
    let recorded = f["optimizers"].as_object().unwrap();
    let modelled: Vec<Optimizer> = Optimizer::all()
        .into_iter()
        .filter(|&o| native(o).is_ok())
        .collect();
    assert_eq!(
        recorded.len(),
        modelled.len(),
        "the fixture records every optimizer the families model"
    );
    for o in modelled {
        let steps = recorded[&o.name()]
            .as_array()
            .unwrap_or_else(|| panic!("{o}"));
        for (k, step) in steps.iter().enumerate() {
            let theirs = step["events"].as_array().unwrap();
            let ours = ours(o, &params, k == 0);
            assert_eq!(&ours, theirs, "{o}, step {}", k + 1);
            assert_eq!(step["leaked_bytes"], 0, "{o}");
        }
    }
}

#[test]
fn the_three_adam_implementations_differ_as_torchs_do() {
    let f = fixture();
    let peak = |name: &str, step: usize| {
        f["optimizers"][name][step]["peak_temporary_bytes"]
            .as_u64()
            .unwrap()
    };
    let bytes: Vec<u64> = f["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| 4 * p["numel"].as_u64().unwrap())
        .collect();
    // foreach: one parameter-sized `_foreach_sqrt` per parameter, all live at once.
    assert_eq!(peak("adam", 1), bytes.iter().sum::<u64>());
    // for-loop: the largest parameter's square root and quotient, beside the previous one's
    // quotient (its `denom`, alive until the name is rebound).
    let largest = bytes
        .iter()
        .position(|b| b == bytes.iter().max().unwrap())
        .unwrap();
    assert_eq!(
        peak("adam-for-loop", 1),
        2 * bytes[largest] + bytes[largest - 1]
    );
    // fused: none.
    assert_eq!(peak("adam-fused", 1), 0);
    // The fused kernel's step counters are on the GPU: 4 bytes per parameter.
    let state = |name: &str| f["optimizers"][name][0]["state_bytes"].as_u64().unwrap();
    assert_eq!(state("adam-fused") - state("adam"), 4 * bytes.len() as u64);
}
