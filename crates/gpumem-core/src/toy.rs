//! A toy model of identical blocks, traced at any batch size and depth: what the depth
//! rebuild and the batch carry-over are tested on.

use crate::trace::{Category, Phase, Trace, TraceBuilder, TraceHeader};

/// A toy of `depth` blocks at `batch` over two iterations: each block's activation kept
/// for backward and a temporary there (both batch-sized), a gradient per block, a
/// `_foreach_add_` over all gradients in the step; `over_blocks`: a buffer over all blocks
/// made in backward by that op (declared `sized_by_parameters` where `declared`), batch-
/// sized where `batched`; `coincide`: a constant temporary in each block alike at batch 4
/// to the batch-sized one (the events before them tell them apart); `views`: after each
/// block's matmul a view, of a constant size in even blocks and batch-sized in odd ones,
/// alike at batch 4 after alike events.
#[derive(Default)]
pub(crate) struct Toy {
    pub over_blocks: Option<(&'static str, bool, bool)>,
    pub coincide: bool,
    pub views: bool,
}

impl Toy {
    pub(crate) fn trace(&self, batch: u64, depth: u32, cut_of: Option<u32>) -> Trace {
        let mut h = TraceHeader::new("toy", batch);
        (h.blocks, h.depth) = (cut_of, cut_of.map(|_| depth));
        if let Some((op, true, _)) = self.over_blocks {
            h.sized_by_parameters = vec![op.to_string()];
        }
        let mut b = TraceBuilder::new(h);
        let mut id = 0u64;
        let mut alloc =
            |b: &mut TraceBuilder, bytes: u64, c: Category, p: Phase, op: &str, module: String| {
                id += 1;
                b.alloc_with_id(0, id, bytes, c, p, op, Some(&module), 0)
                    .unwrap();
                id
            };
        for l in 0..depth {
            alloc(
                &mut b,
                1000,
                Category::Parameter,
                Phase::Setup,
                "empty",
                format!("layers.{l}"),
            );
        }
        for _ in 0..2 {
            let input = alloc(
                &mut b,
                64 * batch,
                Category::InputBatch,
                Phase::Forward,
                "embed",
                "embed".into(),
            );
            let mut outputs = vec![input];
            for l in 0..depth {
                outputs.push(alloc(
                    &mut b,
                    256 * batch,
                    Category::Activation,
                    Phase::Forward,
                    "mm",
                    format!("layers.{l}.mlp"),
                ));
                b.op("mm", 100 * batch, 10 * batch + 1000, 10 * batch);
                if self.views {
                    let bytes = if l % 2 == 0 { 1024 } else { 256 * batch };
                    b.op("view", 0, bytes, bytes);
                }
            }
            let mut grads = Vec::new();
            for l in (0..depth as usize).rev() {
                grads.push(alloc(
                    &mut b,
                    1000,
                    Category::Gradient,
                    Phase::Backward,
                    "mm",
                    format!("layers.{l}"),
                ));
                let t = alloc(
                    &mut b,
                    256 * batch,
                    Category::Temporary,
                    Phase::Backward,
                    "mm",
                    format!("layers.{l}.mlp"),
                );
                b.free(t);
                if self.coincide {
                    let t = alloc(
                        &mut b,
                        1024,
                        Category::Temporary,
                        Phase::Backward,
                        "mm",
                        format!("layers.{l}.mlp"),
                    );
                    b.free(t);
                }
                b.free(outputs[l + 1]);
            }
            if let Some((op, _, batched)) = self.over_blocks {
                let per_block = if batched { 8 * batch } else { 1000 };
                let f = alloc(
                    &mut b,
                    per_block * u64::from(depth),
                    Category::Temporary,
                    Phase::Backward,
                    op,
                    String::new(),
                );
                b.free(f);
            }
            b.free(input);
            b.op("_foreach_add_", 0, 1000 * u64::from(depth), 0);
            for g in grads {
                b.free(g);
            }
            b.iteration_end();
        }
        b.finish()
    }
}
