//! Property tests of the caching-allocator model's invariants.

use gpumem_core::allocator::{AllocatorConfig, BlockId, CachingAllocator, SMALL_SIZE};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Malloc { size: u64, stream: u32 },
    Free { pick: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop_oneof![1u64..4096, 4096u64..SMALL_SIZE + 1, SMALL_SIZE..(12 << 20), (12u64 << 20)..(300 << 20)], 0u32..2)
            .prop_map(|(size, stream)| Op::Malloc { size, stream }),
        2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
    ]
}

fn config() -> impl Strategy<Value = AllocatorConfig> {
    prop_oneof![
        Just(AllocatorConfig::default()),
        Just(AllocatorConfig::parse("max_split_size_mb:64").unwrap()),
        Just(AllocatorConfig::parse("roundup_power2_divisions:4").unwrap()),
        Just(AllocatorConfig::parse("expandable_segments:True").unwrap()),
    ]
}

/// Runs one operation; a failed malloc (out of memory) leaves nothing live.
fn apply(a: &mut CachingAllocator, live: &mut Vec<(BlockId, u64)>, op: Op) {
    match op {
        Op::Malloc { size, stream } => {
            if let Ok(b) = a.malloc(size, stream) {
                live.push((b, size));
            }
        }
        Op::Free { pick } => {
            if !live.is_empty() {
                let (b, _) = live.swap_remove(pick % live.len());
                a.free(b);
            }
        }
    }
}

fn check(a: &CachingAllocator, live: &[(BlockId, u64)]) {
    let st = a.stats();
    let snap = a.snapshot();
    let live_sum: u64 = live.iter().map(|&(b, _)| a.block_size(b)).sum();
    assert_eq!(st.allocated, live_sum, "allocated counts the live blocks");
    assert_eq!(
        st.reserved,
        snap.iter().map(|s| s.size).sum::<u64>(),
        "reserved = segment sizes"
    );
    assert!(st.allocated <= st.reserved && st.reserved <= st.peak_reserved);
    for s in &snap {
        assert_eq!(
            s.blocks.iter().map(|b| b.0).sum::<u64>(),
            s.size,
            "blocks tile their segment"
        );
        for w in s.blocks.windows(2) {
            assert!(w[0].1 || w[1].1, "two free neighbours were not coalesced");
        }
    }
    for &(b, request) in live {
        let size = a.block_size(b);
        assert!(
            size >= request && size.is_multiple_of(512),
            "block {size} for request {request}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn invariants_hold_for_any_sequence(cfg in config(), ops in prop::collection::vec(op(), 1..200)) {
        let mut a = CachingAllocator::new(cfg.clone(), 2 << 30);
        let mut live: Vec<(BlockId, u64)> = Vec::new();
        for o in ops {
            apply(&mut a, &mut live, o);
            check(&a, &live);
        }
        for (b, _) in live.drain(..) {
            a.free(b);
        }
        check(&a, &live);
        prop_assert_eq!(a.stats().allocated, 0);
        if !cfg.expandable_segments {
            for s in a.snapshot() {
                prop_assert_eq!(s.blocks.len(), 1, "a segment with no live block is one free block");
            }
        }
        a.release_cached_blocks();
        prop_assert_eq!(a.stats().reserved, 0, "empty_cache returns everything once nothing is live");
    }

    #[test]
    fn capacity_is_never_exceeded(ops in prop::collection::vec(op(), 1..150)) {
        let cap = 256 << 20;
        let mut a = CachingAllocator::new(AllocatorConfig::default(), cap);
        let mut live = Vec::new();
        for o in ops {
            apply(&mut a, &mut live, o);
            prop_assert!(a.stats().peak_reserved <= cap);
        }
    }
}
