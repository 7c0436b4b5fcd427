//! kvtier's CPU attention kernel: attention of the newest queries of many sequences over their
//! KV blocks where they lie in kvtier's pools: float blocks (fp32, fp16, bf16) as they are,
//! int8, int4 and int2 codes widened in registers inside the score and value loops (a code
//! turned into an f32 once for every query row of its GQA group; scales and zero points folded
//! into the queries, the scores or the weights), never as a full-precision copy of the
//! sequence. The contract, and the torch reference this kernel matches, is
//! python/kvtier/attend/call.py; this crate knows nothing of Python or torch (the bindings in
//! crates/kvtier-py build the slices from tensor addresses).
//!
//! [`attend`] checks the whole call first ([`Problem`] sizes against the buffers, every pool
//! descriptor against the problem, every used block's pool and slot against its pool), so no
//! later read can leave a slice; then it runs work items, one per sequence or, for long
//! sequences on several threads, per run of its blocks, each an online (flash-decoding)
//! softmax over its blocks that leaves a partial maximum, sum and fp32 accumulator per (query,
//! head) row and each block's share of the sum; a second pass merges a sequence's partials into
//! its output and its per-block attention mass.
//!
//! The crate also holds the quantized codecs on the CPU ([`quantize`], [`dequantize`],
//! [`transcode`] of packed rows; `codec.rs`), which write the formats attention reads, byte for
//! byte what the torch reference (python/kvtier/codecs/quant.py) writes.
//!
//! Rotated pools (int2-rot and the like: each head vector stored as `x @ H / D`) are read in
//! place too: the queries are rotated once per call (`q @ H`, a fast Walsh-Hadamard transform
//! with the rotation's signs) and score the stored codes directly, and the values accumulate
//! in the rotated basis, apart, and are turned back once per output row (`acc @ H^T`).
//!
//! SIMD: AVX2 + FMA + F16C, detected at run time ([`Isa::Auto`]), else portable loops.
//! Threads: rayon; a call whose work is small runs on the calling thread (waking a pool costs
//! microseconds, more than a decode step of a short sequence takes).

mod codec;
mod driver;
mod error;
mod half;
mod kernels;
mod layout;
mod rotation;

pub use crate::codec::{dequantize, quantize, transcode, BlockDims, PackedFormat, LAYOUT_LEN};
pub use crate::error::{Error, Result};
pub use crate::half::{f16_to_f32, f32_to_f16};
pub use crate::layout::{FloatDtype, Format, PoolDesc, QuantFormat, DESC_LEN, DESC_PTR};

/// One call's sizes (python/kvtier/attend/call.py's `Problem`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Problem {
    /// `S`: sequences
    pub seqs: usize,
    /// `Q`: new queries of each sequence (its last `Q` tokens)
    pub queries: usize,
    /// `Hq`: query heads, a multiple of `kv_heads`
    pub q_heads: usize,
    /// `Hkv`: K/V heads
    pub kv_heads: usize,
    /// `B`: tokens a block
    pub block_size: usize,
    /// `D`: head size
    pub head_dim: usize,
    /// `M`: block-table entries of each sequence
    pub max_blocks: usize,
    /// the layer read (a pool's `layer_override` wins)
    pub layer: usize,
    /// softmax scale, usually `D ** -0.5`
    pub scale: f32,
}

/// One pool: its descriptor and its bytes (`slots * row_bytes` of them, or more).
#[derive(Clone, Copy, Debug)]
pub struct Pool<'a> {
    pub desc: PoolDesc,
    pub bytes: &'a [u8],
}

/// What one call reads.
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    /// `[S, Q, Hq, D]` of `dtype`, little-endian
    pub q: &'a [u8],
    /// the dtype of `q` and of the output
    pub dtype: FloatDtype,
    /// `[S]`: tokens of each sequence, its `Q` new ones included
    pub seq_lens: &'a [i32],
    /// `[S, M]`: the pool of each block (-1: skipped)
    pub block_pool: &'a [i32],
    /// `[S, M]`: the slot of each block in its pool
    pub block_slot: &'a [i32],
    pub pools: &'a [Pool<'a>],
    /// the signs of the rotated pools' Hadamard rotation `H = S * diag(signs)` (`S` Sylvester's
    /// `D x D` matrix of ±1): `D` values of ±1; empty when no pool is rotated
    pub rotation: &'a [f32],
}

/// What one call writes.
#[derive(Debug)]
pub struct Outputs<'a> {
    /// `[S, Q, Hq, D]` of the inputs' `dtype`
    pub out: &'a mut [u8],
    /// `[S, M]` fp32: each block's attention probability, averaged over the `Hq * Q` rows
    pub mass: &'a mut [f32],
}

/// Which inner loops to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Isa {
    /// AVX2 + FMA + F16C where the CPU has them, else [`Isa::Scalar`]
    #[default]
    Auto,
    /// portable loops (what other CPUs run; tests compare the two)
    Scalar,
    /// AVX2 + FMA + F16C: an error on a CPU without them
    Avx2,
}

/// How to run one call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Exec {
    /// 0: rayon's global pool; 1: the calling thread only; n: a pool of n threads (built once)
    pub threads: usize,
    pub isa: Isa,
}

/// Whether this CPU runs the AVX2 + FMA + F16C loops.
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        kernels::avx2::Avx2::detect().is_some()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Attention of each sequence's `Q` newest queries over its blocks, into `outputs`. Checks
/// everything first: on an `Err` nothing was written.
pub fn attend(
    problem: &Problem,
    inputs: &Inputs<'_>,
    outputs: Outputs<'_>,
    exec: Exec,
) -> Result<()> {
    let ctx = driver::Ctx::new(problem, inputs, &outputs)?;
    match exec.isa {
        Isa::Scalar => driver::run(kernels::Scalar, &ctx, outputs, exec.threads),
        Isa::Auto | Isa::Avx2 => {
            #[cfg(target_arch = "x86_64")]
            if let Some(k) = kernels::avx2::Avx2::detect() {
                driver::run(k, &ctx, outputs, exec.threads);
                return Ok(());
            }
            if exec.isa == Isa::Avx2 {
                return Err(error::invalid("isa", "this CPU lacks AVX2, FMA or F16C"));
            }
            driver::run(kernels::Scalar, &ctx, outputs, exec.threads);
        }
    }
    Ok(())
}
