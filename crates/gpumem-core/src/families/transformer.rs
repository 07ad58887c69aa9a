//! The seed's Transformer family (GPUMemNet `NeuroNetGen_scripts/Transformer/transformer.py`):
//! embedding + learned positions, PyTorch `TransformerEncoderLayer`/`TransformerDecoderLayer`
//! stacks (batch_first, post-norm, ReLU feed-forward), mean over the sequence, a linear head.

use std::fmt;

use super::{Keys, SeedValues, SpecError};
use crate::graph::{Activation, Bw, Dtype, Graph, GraphBuilder, TensorId};
use crate::job::Precision;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransformerArch {
    /// Encoder layers only.
    Standard,
    /// Decoder layers, with the embedded input as memory.
    DecoderOnly,
    /// layers/2 encoder layers, then layers/2 decoder layers reading the encoder's output.
    Hybrid,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Transformer {
    pub vocab: u64,
    pub embed: u64,
    pub layers: u64,
    pub heads: u64,
    pub ff: u64,
    pub dropout: f64,
    pub seq: u64,
    pub classes: u64,
    pub arch: TransformerArch,
    /// The flash kernel is used for fp16/bf16 attention (the GPU profile decides).
    pub flash: bool,
    pub samples: Option<u64>,
    /// The seed's full-batch check forward (with grad) before training.
    pub summary: bool,
}

impl Transformer {
    /// Rebuilds a row of the seed's Transformer dataset from its `Filename` (`num_classes:K_
    /// embedding_size:E_num_layers:L_num_heads:H_ff_hidden_size:F_dropout_rate:P_seq_length:S_
    /// input_size:V_num_samples:N_batch_size:B.out`): the standard encoder, fp32, with the
    /// seed's full-batch forward before training. Returns the model and batch size.
    pub fn from_seed_filename(name: &str) -> Result<(Transformer, u64), SpecError> {
        const KEYS: [&str; 10] = [
            "num_classes:",
            "embedding_size:",
            "num_layers:",
            "num_heads:",
            "ff_hidden_size:",
            "dropout_rate:",
            "seq_length:",
            "input_size:",
            "num_samples:",
            "batch_size:",
        ];
        let v = SeedValues::read(name, &KEYS)?;
        let t = Transformer {
            vocab: v.uint(7)?,
            embed: v.uint(1)?,
            layers: v.uint(2)?,
            heads: v.uint(3)?,
            ff: v.uint(4)?,
            dropout: v.rate(5)?,
            seq: v.uint(6)?,
            classes: v.uint(0)?,
            arch: TransformerArch::Standard,
            flash: true,
            samples: Some(v.uint(8)?),
            summary: true,
        };
        if !t.embed.is_multiple_of(t.heads) {
            return Err(SpecError::HeadsDoNotDivide {
                embed: t.embed,
                heads: t.heads,
            });
        }
        Ok((t, v.uint(9)?))
    }

    pub(crate) fn from_keys(kv: &mut Keys) -> Result<Self, SpecError> {
        let arch = match kv.word("arch", Some("standard"))?.as_str() {
            "standard" => TransformerArch::Standard,
            "decoder_only" => TransformerArch::DecoderOnly,
            "hybrid" => TransformerArch::Hybrid,
            other => {
                return Err(SpecError::UnknownChoice {
                    family: "transformer",
                    key: "arch",
                    value: other.into(),
                    expected: "standard, decoder_only or hybrid".into(),
                });
            }
        };
        let t = Transformer {
            vocab: kv.uint("vocab", None, 1, 1 << 24)?,
            embed: kv.uint("embed", None, 1, 1 << 16)?,
            layers: kv.uint("layers", None, 1, 512)?,
            heads: kv.uint("heads", None, 1, 1024)?,
            ff: kv.uint("ff", None, 1, 1 << 18)?,
            dropout: kv.float("dropout", 0.1, 0.0, 0.999)?,
            seq: kv.uint("seq", None, 1, 1 << 20)?,
            classes: kv.uint("classes", None, 1, 1 << 20)?,
            arch,
            flash: kv.boolean("flash", true)?,
            samples: match kv.uint("samples", Some(0), 0, 1 << 40)? {
                0 => None,
                n => Some(n),
            },
            summary: kv.boolean("summary", false)?,
        };
        if !t.embed.is_multiple_of(t.heads) {
            return Err(SpecError::HeadsDoNotDivide {
                embed: t.embed,
                heads: t.heads,
            });
        }
        if t.arch == TransformerArch::Hybrid && t.layers < 2 {
            return Err(SpecError::HybridNeedsTwoLayers);
        }
        Ok(t)
    }

    /// An `nn.MultiheadAttention`'s parameters: in_proj (packed q, k, v) then out_proj.
    fn attention_params(&self, g: &mut GraphBuilder) -> Attn {
        let e = self.embed;
        let in_proj = (g.param(3 * e * e), Some(g.param(3 * e)));
        Attn {
            in_proj,
            out_proj: g.linear_params(e, e, true),
        }
    }

    /// A layer's parameters in PyTorch's registration order: self_attn, [multihead_attn],
    /// linear1, linear2, norm1, norm2, [norm3].
    fn layer_params(&self, g: &mut GraphBuilder, decoder: bool) -> Layer {
        let (e, f) = (self.embed, self.ff);
        let self_attn = self.attention_params(g);
        let cross_attn = decoder.then(|| self.attention_params(g));
        let linear1 = g.linear_params(e, f, true);
        let linear2 = g.linear_params(f, e, true);
        let norms = (0..if decoder { 3 } else { 2 })
            .map(|_| (g.param(e), g.param(e)))
            .collect();
        Layer {
            self_attn,
            cross_attn,
            linear1,
            linear2,
            norms,
        }
    }

    /// `F.multi_head_attention_forward` in training with need_weights=False, batch_first.
    /// `q_in` and `kv_in` are `[B, S, E]`; the same id means self-attention.
    fn attention(
        &self,
        g: &mut GraphBuilder,
        p: &Attn,
        q_in: TensorId,
        kv_in: TensorId,
        b: u64,
    ) -> TensorId {
        let (e, s, h) = (self.embed, self.seq, self.heads);
        let (w_in, b_in) = p.in_proj;
        // The batch_first transpose makes the input non-contiguous: linear falls back to matmul,
        // whose reshape copies it; the bias is added in place.
        let (q, k, v) = if q_in == kv_in {
            let xc = g.copy(q_in);
            let proj = g.linear_with(xc, w_in, b_in, e, 3 * e);
            // unflatten/transpose/.contiguous(): a packed [3, S, B, E] copy, viewed as q, k, v.
            let packed = g.contiguous_copy(proj);
            let p = g.unpack(packed, 3);
            (p[0], p[1], p[2])
        } else {
            let qc = g.copy(q_in);
            let q = g.linear_with(qc, w_in, b_in, e, e);
            let kc = g.copy(kv_in);
            let kv = g.linear_with(kc, w_in, b_in, e, 2 * e);
            let packed = g.contiguous_copy(kv);
            let p = g.unpack(packed, 2);
            (q, p[0], p[1])
        };
        let dt = g.t(q).dtype;
        let flash = self.flash && dt != Dtype::F32;
        let att = g.sdpa(q, k, v, b, h, s, e / h, flash);
        let merged = g.copy(att);
        let out = g.linear_with(merged, p.out_proj.0, p.out_proj.1, e, e);
        // Back to batch-first: `attn_output.transpose(1, 0)`.
        g.strided_view(out)
    }

    fn feed_forward(&self, g: &mut GraphBuilder, p: &Layer, x: TensorId) -> TensorId {
        let y = g.linear_with(x, p.linear1.0, p.linear1.1, self.embed, self.ff);
        let y = g.activation(y, Activation::Relu);
        let y = g.dropout(y, self.dropout);
        let y = g.linear_with(y, p.linear2.0, p.linear2.1, self.ff, self.embed);
        g.dropout(y, self.dropout)
    }

    /// Post-norm: x = norm1(x + dropout(sa(x))); [x = norm2(x + dropout(mha(x, memory)))];
    /// x = normN(x + ff(x)).
    fn layer(
        &self,
        g: &mut GraphBuilder,
        p: &Layer,
        src: TensorId,
        memory: Option<TensorId>,
        b: u64,
    ) -> TensorId {
        let e = self.embed;
        let x = src;
        let sa = self.attention(g, &p.self_attn, x, x, b);
        let sa = g.dropout(sa, self.dropout);
        let x = g.add(x, sa);
        let mut x = g.layer_norm_with(x, p.norms[0], e);
        if let (Some(cross), Some(m)) = (&p.cross_attn, memory) {
            let ca = self.attention(g, cross, x, m, b);
            let ca = g.dropout(ca, self.dropout);
            let y = g.add(x, ca);
            x = g.layer_norm_with(y, p.norms[1], e);
        }
        let ff = self.feed_forward(g, p, x);
        let y = g.add(x, ff);
        let out = g.layer_norm_with(y, p.norms[p.norms.len() - 1], e);
        // `forward(src, ...)` keeps its argument until it returns.
        g.hold_until_now(src);
        out
    }

    pub fn graph(&self, batch: u64, precision: Precision) -> Graph {
        let mut g = GraphBuilder::new(precision);
        let (b, s, e) = (batch, self.seq, self.embed);
        let tokens = g.input(b * s, Dtype::I64);
        let labels = g.input(b, Dtype::I64);
        // Registration order: the model's own positional parameter, then embedding, the
        // stack(s), fc_out.
        let pos = g.param(s * e);
        let table = g.param(self.vocab * e);
        let (n_enc, n_dec) = match self.arch {
            TransformerArch::Standard => (self.layers, 0),
            TransformerArch::DecoderOnly => (0, self.layers),
            TransformerArch::Hybrid => (self.layers / 2, self.layers / 2),
        };
        let enc: Vec<Layer> = (0..n_enc)
            .map(|_| self.layer_params(&mut g, false))
            .collect();
        let dec: Vec<Layer> = (0..n_dec)
            .map(|_| self.layer_params(&mut g, true))
            .collect();
        let head = g.linear_params(e, self.classes, true);
        let emb = g.embedding_with(tokens, table, e);
        // x = embedding + positions: the [1, S, E] parameter's gradient is a reduction.
        let mut x = g.node(
            "add",
            &[emb, pos],
            &[(b * s * e, Dtype::F32)],
            &[],
            &[Bw::PassThrough(0), Bw::Grad(1)],
            b * s * e,
            false,
        )[0];
        let input = x;
        let mut memory = input;
        // The stacks' `src`/`tgt` and the model's `x` hold each stack's input until it returns.
        for p in &enc {
            x = self.layer(&mut g, p, x, None, b);
        }
        if !enc.is_empty() {
            g.hold_until_now(input);
        }
        if self.arch == TransformerArch::Hybrid {
            memory = x;
            x = input;
        }
        for p in &dec {
            x = self.layer(&mut g, p, x, Some(memory), b);
        }
        if !dec.is_empty() {
            g.hold_until_now(input);
            g.hold_until_now(memory);
        }
        let dt = g.t(x).dtype;
        let pooled = g.node(
            "mean",
            &[x],
            &[(b * e, dt)],
            &[],
            &[Bw::Grad(0)],
            b * s * e,
            false,
        )[0];
        let logits = g.linear_with(pooled, head.0, head.1, e, self.classes);
        g.end_model(logits);
        let per_layer = if self.arch == TransformerArch::DecoderOnly {
            3
        } else {
            2
        };
        g.set_activations_per_sample(
            s * e * (2 + per_layer * self.layers) + s * self.ff * self.layers + self.classes,
        );
        let loss = g.cross_entropy(logits, labels);
        g.finish(loss)
    }
}

struct Attn {
    in_proj: (TensorId, Option<TensorId>),
    out_proj: (TensorId, Option<TensorId>),
}

struct Layer {
    self_attn: Attn,
    cross_attn: Option<Attn>,
    linear1: (TensorId, Option<TensorId>),
    linear2: (TensorId, Option<TensorId>),
    norms: Vec<(TensorId, TensorId)>,
}

impl fmt::Display for Transformer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let arch = match self.arch {
            TransformerArch::Standard => "standard",
            TransformerArch::DecoderOnly => "decoder_only",
            TransformerArch::Hybrid => "hybrid",
        };
        write!(
            f,
            "transformer:vocab={},embed={},layers={},heads={},ff={},dropout={},seq={},classes={},arch={arch}",
            self.vocab,
            self.embed,
            self.layers,
            self.heads,
            self.ff,
            self.dropout,
            self.seq,
            self.classes
        )?;
        if !self.flash {
            write!(f, ",flash=false")?;
        }
        super::write_loop_keys(f, self.samples, self.summary)
    }
}
