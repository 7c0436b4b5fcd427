//! Pools as the kernel reads them: the 16-int64 descriptor of python/kvtier/attend/call.py
//! (`DESC_FIELDS`) parsed into a [`PoolDesc`], checked once per call against the problem's
//! sizes ([`PoolDesc::check`]), then turned into byte ranges of one block's K or V of one head
//! ([`Blocks`]). Every range a block read uses lies inside its slot's row, and every row inside
//! the pool's bytes, once `check` has passed and the slot is below `slots`.
//!
//! Layouts (one row per slot):
//! - float: `[layers, 2, Hkv, B, D]` elements of the pool's dtype, K then V;
//! - quant: sections at byte offsets within the row: codes `[layers, 2, Hkv, B, D * bits / 8]`
//!   (4-bit: even `d` in the low nibble; 2-bit: `d = 4i + j` in bits `2j..2j + 2` of byte `i`;
//!   a token's codes start on a whole byte), `k_scale`/`k_zero` fp16 `[layers, Hkv, Gk]` (`Gk =
//!   D` per channel, else `B * D / group` per token), `v_scale`/`v_zero` `[layers, Hkv, B * D /
//!   group]`; zero points only when asymmetric. Sections need no alignment. A rotated format
//!   (flags bit 2) holds each K and V head vector `x` as `x @ H / D` quantized, `H` the call's
//!   Hadamard rotation (`Inputs::rotation`): the kernel scores and accumulates in that basis.

use crate::error::{Error, Result};

/// The int64s of one pool descriptor.
pub const DESC_LEN: usize = 16;

/// Index of the `ptr` field (the address of slot 0; the bindings use it, the core does not).
pub const DESC_PTR: usize = 3;

/// The element type of a float pool, of the queries and of the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatDtype {
    F32,
    F16,
    Bf16,
}

impl FloatDtype {
    /// From the descriptor's code (and `q_dtype`'s): 0 fp32, 1 fp16, 2 bf16.
    pub fn from_code(code: i64) -> Option<Self> {
        match code {
            0 => Some(Self::F32),
            1 => Some(Self::F16),
            2 => Some(Self::Bf16),
            _ => None,
        }
    }

    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }

    /// Whether `bytes`, values of this dtype in native order, hold no NaN nor infinity (a
    /// value with every exponent bit set).
    pub fn all_finite(self, bytes: &[u8]) -> bool {
        match self {
            Self::F32 => bytes
                .chunks_exact(4)
                .all(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) & 0x7f80_0000 != 0x7f80_0000),
            Self::F16 => bytes
                .chunks_exact(2)
                .all(|b| u16::from_ne_bytes([b[0], b[1]]) & 0x7c00 != 0x7c00),
            Self::Bf16 => bytes
                .chunks_exact(2)
                .all(|b| u16::from_ne_bytes([b[0], b[1]]) & 0x7f80 != 0x7f80),
        }
    }
}

/// Where the sections of a quantized row lie, and how its values are grouped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantFormat {
    /// 2, 4 or 8
    pub bits: u8,
    /// codes unsigned with an fp16 zero point per group (else two's complement, no zero)
    pub asymmetric: bool,
    /// keys grouped per channel along the block's tokens (else per token, like values)
    pub key_per_channel: bool,
    /// keys and values stored rotated (`x @ H / D`, `H` the call's rotation)
    pub rotated: bool,
    /// values per group along D (per-token groups)
    pub group: usize,
    pub codes: usize,
    pub k_scale: usize,
    pub k_zero: usize,
    pub v_scale: usize,
    pub v_zero: usize,
}

impl QuantFormat {
    /// Codes that share one byte: 1, 2 or 4.
    pub fn per_byte(&self) -> usize {
        8 / usize::from(self.bits)
    }

    /// Checks that blocks of head dimension `dim` pack in this format: whole bytes of codes per
    /// token, groups that divide the head.
    pub(crate) fn check_dim(&self, dim: usize) -> std::result::Result<(), String> {
        let per_byte = self.per_byte();
        if !dim.is_multiple_of(per_byte) {
            return Err(format!(
                "head_dim {dim}: {}-bit codes need a head_dim that is a multiple of {per_byte}",
                self.bits
            ));
        }
        if self.group == 0 || !dim.is_multiple_of(self.group) {
            return Err(format!(
                "group {}: expected a divisor of head_dim {dim}",
                self.group
            ));
        }
        if self.rotated && !dim.is_power_of_two() {
            return Err(format!(
                "head_dim {dim}: a rotated format needs a power of two (its Hadamard rotation)"
            ));
        }
        Ok(())
    }

    /// Groups of one (layer, head) tile of `block` tokens: `(keys, values)`.
    pub(crate) fn groups(&self, block: usize, dim: usize) -> (usize, usize) {
        let v = block * (dim / self.group);
        (if self.key_per_channel { dim } else { v }, v)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Float(FloatDtype),
    Quant(QuantFormat),
}

/// One pool, as its descriptor describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolDesc {
    pub format: Format,
    pub slots: usize,
    pub row_bytes: usize,
    pub layers: usize,
    /// read at this layer whatever the call's (a staging pool holds one layer)
    pub layer_override: Option<usize>,
}

fn nonneg(fields: &[i64], i: usize, name: &str) -> std::result::Result<usize, String> {
    usize::try_from(fields[i]).map_err(|_| format!("{name}: expected >= 0, got {}", fields[i]))
}

impl PoolDesc {
    /// Parses the `DESC_FIELDS` int64s (`kind, dtype_or_bits, flags, ptr, slots, row_bytes,
    /// layers, layer_override, group, codes, k_scale, k_zero, v_scale, v_zero, _, _`); `pool`
    /// names it in errors.
    pub fn from_fields(pool: usize, fields: &[i64]) -> Result<Self> {
        Self::parse(fields).map_err(|reason| Error::InvalidPool { pool, reason })
    }

    fn parse(f: &[i64]) -> std::result::Result<Self, String> {
        if f.len() != DESC_LEN {
            return Err(format!(
                "expected {DESC_LEN} descriptor fields, got {}",
                f.len()
            ));
        }
        let format = match f[0] {
            0 => Format::Float(FloatDtype::from_code(f[1]).ok_or_else(|| {
                format!(
                    "float dtype: expected 0 (fp32), 1 (fp16) or 2 (bf16), got {}",
                    f[1]
                )
            })?),
            1 => {
                let bits = match f[1] {
                    2 => 2,
                    4 => 4,
                    8 => 8,
                    b => return Err(format!("bits: expected 2, 4 or 8, got {b}")),
                };
                if f[2] & !7 != 0 {
                    return Err(format!("flags: expected bits 0 to 2 only, got {}", f[2]));
                }
                let asymmetric = f[2] & 1 != 0;
                let zero = |i: usize, name: &str| {
                    if asymmetric {
                        nonneg(f, i, name)
                    } else {
                        Ok(0)
                    }
                };
                Format::Quant(QuantFormat {
                    bits,
                    asymmetric,
                    key_per_channel: f[2] & 2 != 0,
                    rotated: f[2] & 4 != 0,
                    group: nonneg(f, 8, "group")?,
                    codes: nonneg(f, 9, "codes offset")?,
                    k_scale: nonneg(f, 10, "k_scale offset")?,
                    k_zero: zero(11, "k_zero offset")?,
                    v_scale: nonneg(f, 12, "v_scale offset")?,
                    v_zero: zero(13, "v_zero offset")?,
                })
            }
            k => return Err(format!("kind: expected 0 (float) or 1 (quant), got {k}")),
        };
        let layer_override = match f[7] {
            -1 => None,
            l => Some(
                usize::try_from(l)
                    .map_err(|_| format!("layer_override: expected -1 or >= 0, got {l}"))?,
            ),
        };
        Ok(Self {
            format,
            slots: nonneg(f, 4, "slots")?,
            row_bytes: nonneg(f, 5, "row_bytes")?,
            layers: nonneg(f, 6, "layers")?,
            layer_override,
        })
    }

    /// The pool's extent in bytes, `slots * row_bytes` (None on overflow).
    pub fn extent(&self) -> Option<usize> {
        self.slots.checked_mul(self.row_bytes)
    }

    /// Checks that a row of this pool holds blocks of `dims` (every layer's, every section),
    /// that the layer read exists and that `bytes` holds every slot; returns how to address
    /// one block's K and V.
    pub(crate) fn check(
        &self,
        pool: usize,
        dims: Dims,
        layer: usize,
        bytes: usize,
    ) -> Result<Blocks> {
        let fail = |reason: String| Error::InvalidPool { pool, reason };
        let extent = self
            .extent()
            .ok_or_else(|| fail("slots * row_bytes overflows".into()))?;
        if bytes < extent {
            return Err(fail(format!(
                "{} slots of {} bytes need {extent} bytes, the pool's buffer has {bytes}",
                self.slots, self.row_bytes
            )));
        }
        let at = self.layer_override.unwrap_or(layer);
        if at >= self.layers {
            return Err(fail(format!(
                "layer {at} out of range of its {} layers",
                self.layers
            )));
        }
        let Dims { heads, block, dim } = dims;
        let overflow = || fail("the row's size overflows".into());
        let m = |a: usize, b: usize| a.checked_mul(b).ok_or_else(overflow);
        let fits = |name: &str, offset: usize, len: usize| {
            let end = offset.checked_add(len).ok_or_else(overflow)?;
            if end > self.row_bytes {
                return Err(fail(format!(
                    "{name}: bytes {offset}..{end} lie past the row's {} bytes",
                    self.row_bytes
                )));
            }
            Ok(())
        };
        // bytes of one (layer, K or V, head) tile of a block
        match self.format {
            Format::Float(dtype) => {
                let tile = m(m(block, dim)?, dtype.size())?;
                fits("float blocks", 0, m(m(m(self.layers, 2)?, heads)?, tile)?)?;
                Ok(Blocks {
                    format: self.format,
                    row_bytes: self.row_bytes,
                    k: (2 * at * heads) * tile,
                    v: (2 * at + 1) * heads * tile,
                    head: tile,
                    k_scale: 0,
                    k_zero: 0,
                    v_scale: 0,
                    v_zero: 0,
                    k_groups: 0,
                    v_groups: 0,
                })
            }
            Format::Quant(q) => {
                q.check_dim(dim).map_err(fail)?;
                let code_row = dim * usize::from(q.bits) / 8;
                let tile = m(block, code_row)?;
                fits("codes", q.codes, m(m(m(self.layers, 2)?, heads)?, tile)?)?;
                m(block, dim / q.group)?;
                let (k_groups, v_groups) = q.groups(block, dim);
                let k_bytes = m(m(m(self.layers, heads)?, k_groups)?, 2)?;
                let v_bytes = m(m(m(self.layers, heads)?, v_groups)?, 2)?;
                fits("k_scale", q.k_scale, k_bytes)?;
                fits("v_scale", q.v_scale, v_bytes)?;
                if q.asymmetric {
                    fits("k_zero", q.k_zero, k_bytes)?;
                    fits("v_zero", q.v_zero, v_bytes)?;
                }
                let k_head = 2 * k_groups;
                let v_head = 2 * v_groups;
                Ok(Blocks {
                    format: self.format,
                    row_bytes: self.row_bytes,
                    k: q.codes + 2 * at * heads * tile,
                    v: q.codes + (2 * at + 1) * heads * tile,
                    head: tile,
                    k_scale: q.k_scale + at * heads * k_head,
                    k_zero: q.k_zero + at * heads * k_head,
                    v_scale: q.v_scale + at * heads * v_head,
                    v_zero: q.v_zero + at * heads * v_head,
                    k_groups,
                    v_groups,
                })
            }
        }
    }
}

/// The sizes of one block's tile: K/V heads, tokens, head dimension.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub heads: usize,
    pub block: usize,
    pub dim: usize,
}

/// How to find one (head, K or V) tile of a block at the call's layer: byte offsets within a
/// row, head 0 (add `head * g` to reach head `g`). Built by [`PoolDesc::check`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Blocks {
    pub format: Format,
    pub row_bytes: usize,
    /// K's and V's tile of head 0 (codes, for quant pools)
    pub k: usize,
    pub v: usize,
    /// bytes from one head's tile to the next
    pub head: usize,
    /// scale and zero sections of head 0 (quant pools); from head to head: `2 * groups`
    pub k_scale: usize,
    pub k_zero: usize,
    pub v_scale: usize,
    pub v_zero: usize,
    pub k_groups: usize,
    pub v_groups: usize,
}

impl Blocks {
    /// Whether the pool's K and V are stored rotated.
    #[inline]
    pub fn rotated(&self) -> bool {
        matches!(self.format, Format::Quant(q) if q.rotated)
    }

    /// The row of `slot` (checked by the caller: `slot < slots`).
    #[inline]
    pub fn row<'a>(&self, bytes: &'a [u8], slot: usize) -> &'a [u8] {
        &bytes[slot * self.row_bytes..(slot + 1) * self.row_bytes]
    }
}
