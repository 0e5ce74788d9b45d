//! The shape of a block and the canonical bytes that bind ids to it.

use crate::error::{Error, Result};

/// Element type of the KV tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE half precision.
    Float16,
    /// bfloat16.
    BFloat16,
    /// IEEE single precision.
    Float32,
    /// fp8 e4m3 (`float8_e4m3fn`).
    Float8E4M3,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Float16 | DType::BFloat16 => 2,
            DType::Float32 => 4,
            DType::Float8E4M3 => 1,
        }
    }

    /// The torch name (`torch.bfloat16` -> `"bfloat16"`).
    pub fn name(self) -> &'static str {
        match self {
            DType::Float16 => "float16",
            DType::BFloat16 => "bfloat16",
            DType::Float32 => "float32",
            DType::Float8E4M3 => "float8_e4m3fn",
        }
    }

    /// Parses a dtype name as torch spells it (`float16`, `bfloat16`, ...).
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "float16" | "half" | "fp16" => DType::Float16,
            "bfloat16" | "bf16" => DType::BFloat16,
            "float32" | "float" | "fp32" => DType::Float32,
            "float8_e4m3fn" | "fp8" | "float8" => DType::Float8E4M3,
            other => {
                return Err(Error::InvalidInput(format!(
                "dtype: expected one of float16, bfloat16, float32, float8_e4m3fn, got {other:?}"
            )))
            }
        })
    }
}

/// How a store keeps a block's values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Storage {
    /// The layout's dtype, bit for bit.
    #[default]
    Exact,
    /// Lossy: fp8 e4m3 values and, per (layer, K/V, kv head), one float32
    /// scale (`value = e4m3 * scale`). The caller quantizes and dequantizes;
    /// the store keeps the bytes. Each `[B, H, D]` run is followed by its `H`
    /// scales (little-endian), so a run is `B*H*D + 4*H` bytes.
    Fp8,
}

impl Storage {
    /// Name in the MANIFEST and the Python API.
    pub fn name(self) -> &'static str {
        match self {
            Storage::Exact => "exact",
            Storage::Fp8 => "fp8",
        }
    }

    /// Parses [`Storage::name`].
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "exact" => Ok(Storage::Exact),
            "fp8" => Ok(Storage::Fp8),
            other => Err(Error::InvalidInput(format!(
                "storage: expected 'exact' or 'fp8', got {other:?}"
            ))),
        }
    }
}

/// What a block's two runs per layer hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Kind {
    /// K and V: a block is `[L, 2, B, H, D]`, K at index 0, V at index 1.
    #[default]
    KeyValue,
    /// One latent vector per token and layer (MLA: DeepSeek-V2/V3, Kimi K2),
    /// `W` wide. Stored as the two halves of the latent, each a run of
    /// `[B, 1, W / 2]` (`num_kv_heads` 1, `head_dim` `W / 2`): the runs, codecs
    /// and paged copies of K/V blocks serve it unchanged, and a block holds
    /// the latent once (`L * B * W` elements).
    Latent,
}

impl Kind {
    /// Name in the MANIFEST.
    pub fn name(self) -> &'static str {
        match self {
            Kind::KeyValue => "kv",
            Kind::Latent => "latent",
        }
    }

    /// Parses [`Kind::name`].
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "kv" => Ok(Kind::KeyValue),
            "latent" => Ok(Kind::Latent),
            other => Err(Error::InvalidInput(format!(
                "kind: expected 'kv' or 'latent', got {other:?}"
            ))),
        }
    }
}

/// `num_layers L`, `num_kv_heads H`, `head_dim D`, `dtype`, `block_size B`.
/// A block is logically `[L, 2, B, H, D]`, K at index 0 and V at index 1
/// (a latent block: see [`Kind::Latent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    /// Transformer layers `L`.
    pub num_layers: u32,
    /// KV heads `H` (fewer than query heads with GQA).
    pub num_kv_heads: u32,
    /// Head dimension `D`.
    pub head_dim: u32,
    /// Element type.
    pub dtype: DType,
    /// Tokens per block `B`.
    pub block_size: u32,
    /// How blocks are stored (the dtype is what callers put and get).
    pub storage: Storage,
    /// K/V or a latent.
    pub kind: Kind,
}

/// Upper bound on one block's payload. Keeps every size computation far from
/// overflow and refuses layouts no accelerator could hold anyway.
pub const MAX_BLOCK_BYTES: usize = 1 << 31;

impl Layout {
    /// Checks every field; the only way engine code builds a `Layout` from user input.
    pub fn new(
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        dtype: DType,
        block_size: u32,
    ) -> Result<Self> {
        let layout = Layout {
            num_layers,
            num_kv_heads,
            head_dim,
            dtype,
            block_size,
            storage: Storage::Exact,
            kind: Kind::KeyValue,
        };
        for (name, v) in [
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
        ] {
            if v == 0 {
                return Err(Error::InvalidInput(format!(
                    "{name}: expected a positive integer, got 0"
                )));
            }
        }
        let bytes = u128::from(num_layers)
            * 2
            * u128::from(block_size)
            * u128::from(num_kv_heads)
            * u128::from(head_dim)
            * (dtype.size() as u128);
        if bytes > MAX_BLOCK_BYTES as u128 {
            return Err(Error::InvalidInput(format!(
                "layout: a block would take {bytes} bytes, more than the limit of {MAX_BLOCK_BYTES}"
            )));
        }
        Ok(layout)
    }

    /// A latent layout ([`Kind::Latent`]): `width` elements per token and
    /// layer (`kv_lora_rank + qk_rope_head_dim`), even.
    pub fn latent(num_layers: u32, width: u32, dtype: DType, block_size: u32) -> Result<Self> {
        if width == 0 || !width.is_multiple_of(2) {
            return Err(Error::InvalidInput(format!(
                "latent width: expected a positive even integer, got {width}"
            )));
        }
        let l = Layout::new(num_layers, 1, width / 2, dtype, block_size)?;
        Ok(Layout {
            kind: Kind::Latent,
            ..l
        })
    }

    /// A layout of `kind` as a MANIFEST or the Python `Layout` names it: for a
    /// latent, `head_dim` is its width and `num_kv_heads` must be 1.
    pub fn of_kind(
        kind: Kind,
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        dtype: DType,
        block_size: u32,
    ) -> Result<Self> {
        match kind {
            Kind::KeyValue => Layout::new(num_layers, num_kv_heads, head_dim, dtype, block_size),
            Kind::Latent if num_kv_heads == 1 => {
                Layout::latent(num_layers, head_dim, dtype, block_size)
            }
            Kind::Latent => Err(Error::InvalidInput(format!(
                "a latent layout has one kv head, got num_kv_heads {num_kv_heads}"
            ))),
        }
    }

    /// The latent width `W` of a [`Kind::Latent`] layout (`None` for K/V).
    pub fn latent_width(&self) -> Option<u32> {
        (self.kind == Kind::Latent).then_some(2 * self.head_dim)
    }

    /// This layout with `storage`: fp8 storage of a 16- or 32-bit dtype.
    pub fn with_storage(self, storage: Storage) -> Result<Self> {
        if storage == Storage::Fp8 && self.dtype == DType::Float8E4M3 {
            return Err(Error::InvalidInput(
                "storage: 'fp8' stores float16, bfloat16 or float32 KV as fp8; \
                 this layout's dtype is float8_e4m3fn already"
                    .into(),
            ));
        }
        Ok(Layout { storage, ..self })
    }

    /// Bytes of one stored element.
    fn stored_size(&self) -> usize {
        match self.storage {
            Storage::Exact => self.dtype.size(),
            Storage::Fp8 => 1,
        }
    }

    /// Bytes of one token's K (or V) for one layer as stored: `H * D * elem`.
    pub fn token_bytes(&self) -> usize {
        self.num_kv_heads as usize * self.head_dim as usize * self.stored_size()
    }

    /// Bytes of one run (one layer, K or V, one block): `[B, H, D]`, then,
    /// with fp8 storage, the `H` float32 scales.
    pub fn chunk_bytes(&self) -> usize {
        let scales = match self.storage {
            Storage::Exact => 0,
            Storage::Fp8 => 4 * self.num_kv_heads as usize,
        };
        self.block_size as usize * self.token_bytes() + scales
    }

    /// Element size of the payload's planes for the codecs (1 for fp8).
    pub fn elem_size(&self) -> usize {
        self.stored_size()
    }

    /// Bytes of one block `[L, 2, B, H, D]`.
    pub fn block_bytes(&self) -> usize {
        self.num_layers as usize * 2 * self.chunk_bytes()
    }

    /// The `2L` runs (`[B, H, D]` each) of block `i` in a contiguous
    /// `[L, 2, total_tokens, H, D]` buffer; with fp8 storage, in a
    /// `[L, 2, total_tokens / B, chunk_bytes]` buffer (block-major runs, each
    /// with its scales).
    pub fn block_runs<'a>(&self, kv: &'a [u8], total_tokens: usize, i: usize) -> Vec<&'a [u8]> {
        let (stride, at, len) = self.run_geometry(total_tokens, i);
        kv.chunks(stride)
            .take(self.num_layers as usize * 2)
            .map(|run| &run[at..at + len])
            .collect()
    }

    /// [`Layout::block_runs`], writable.
    pub fn block_runs_mut<'a>(
        &self,
        kv: &'a mut [u8],
        total_tokens: usize,
        i: usize,
    ) -> Vec<&'a mut [u8]> {
        let (stride, at, len) = self.run_geometry(total_tokens, i);
        kv.chunks_mut(stride)
            .take(self.num_layers as usize * 2)
            .map(|run| &mut run[at..at + len])
            .collect()
    }

    /// `kv` (a buffer of [`Layout::block_runs`] of `total_tokens`) cut into
    /// groups of consecutive blocks, `bounds[g]..bounds[g + 1]` for group
    /// `g` (`bounds` ascending): each group's part of every (layer, K/V) run,
    /// its `2L` runs of `blocks` chunks, so that groups are written apart.
    pub fn split_runs_mut<'a>(
        &self,
        kv: &'a mut [u8],
        total_tokens: usize,
        bounds: &[usize],
    ) -> Vec<Vec<&'a mut [u8]>> {
        let groups = bounds.len().saturating_sub(1);
        let mut out: Vec<Vec<&mut [u8]>> = (0..groups).map(|_| Vec::new()).collect();
        let Some((&first, &last)) = bounds.first().zip(bounds.last()) else {
            return out;
        };
        let (stride, from, _) = self.run_geometry(total_tokens, first);
        let to = self.run_geometry(total_tokens, last).1;
        for run in kv.chunks_mut(stride).take(self.num_layers as usize * 2) {
            let mut rest = &mut run[from..to];
            for (group, w) in out.iter_mut().zip(bounds.windows(2)) {
                let (head, tail) = rest.split_at_mut((w[1] - w[0]) * self.chunk_bytes());
                group.push(head);
                rest = tail;
            }
        }
        out
    }

    /// (bytes per `[T, H, D]` run, offset of block `i` in a run, bytes of it).
    fn run_geometry(&self, total_tokens: usize, i: usize) -> (usize, usize, usize) {
        let (b, chunk) = (self.block_size as usize, self.chunk_bytes());
        match self.storage {
            Storage::Exact => {
                let tb = self.token_bytes();
                (total_tokens * tb, i * b * tb, chunk)
            }
            Storage::Fp8 => (total_tokens / b * chunk, i * chunk, chunk),
        }
    }

    /// Bytes of the KV of `tokens` tokens: a contiguous `[L, 2, T, H, D]`
    /// tensor; with fp8 storage the blocked buffer of [`Layout::block_runs`]
    /// (`None` unless `tokens` is a multiple of `B`).
    pub fn kv_bytes(&self, tokens: usize) -> Option<usize> {
        let runs = self.num_layers as usize * 2;
        match self.storage {
            Storage::Exact => runs.checked_mul(tokens)?.checked_mul(self.token_bytes()),
            Storage::Fp8 => {
                let b = self.block_size as usize;
                if !tokens.is_multiple_of(b) {
                    return None;
                }
                runs.checked_mul(tokens / b)?
                    .checked_mul(self.chunk_bytes())
            }
        }
    }

    /// Canonical encoding, part of the block-id key: explicit little-endian,
    /// never depends on the platform.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(32);
        for x in [
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
        ] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        let name = self.dtype.name().as_bytes();
        v.extend_from_slice(&(name.len() as u32).to_le_bytes());
        v.extend_from_slice(name);
        // Exact layouts keep the bytes (and so the ids) they always had; a
        // lossy store's ids differ, so it never serves an exact request.
        if self.storage != Storage::Exact {
            let s = self.storage.name().as_bytes();
            v.extend_from_slice(&(s.len() as u32).to_le_bytes());
            v.extend_from_slice(s);
        }
        // Likewise a latent's: never the ids of a one-head K/V layout.
        if self.kind != Kind::KeyValue {
            let k = self.kind.name().as_bytes();
            v.extend_from_slice(b"kind");
            v.extend_from_slice(&(k.len() as u32).to_le_bytes());
            v.extend_from_slice(k);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        let l = Layout::new(32, 8, 128, DType::BFloat16, 16).unwrap();
        assert_eq!(l.chunk_bytes(), 16 * 8 * 128 * 2);
        assert_eq!(l.block_bytes(), 32 * 2 * 16 * 8 * 128 * 2);
        assert_eq!(l.kv_bytes(3), Some(32 * 2 * 3 * 8 * 128 * 2));
    }

    #[test]
    fn split_runs_are_the_blocks_runs() {
        let exact = Layout::new(3, 2, 4, DType::Float16, 2).unwrap();
        let fp8 = exact.with_storage(Storage::Fp8).unwrap();
        // A partial block at the end is in no group (fp8 buffers have none).
        for (l, t) in [(exact, 7 * 2 + 1), (fp8, 7 * 2)] {
            let kv: Vec<u8> = (0..l.kv_bytes(t).unwrap()).map(|i| i as u8).collect();
            let mut split = kv.clone();
            let groups = l.split_runs_mut(&mut split, t, &[1, 4, 5, 7]);
            assert_eq!(groups.len(), 3);
            for (g, (lo, hi)) in groups.iter().zip([(1, 4), (4, 5), (5, 7)]) {
                assert_eq!(g.len(), 6);
                for (r, run) in g.iter().enumerate() {
                    let expect: Vec<u8> = (lo..hi)
                        .flat_map(|i| l.block_runs(&kv, t, i)[r].to_vec())
                        .collect();
                    assert_eq!(**run, *expect, "{l:?}");
                }
            }
        }
    }

    #[test]
    fn fp8_storage_sizes_and_runs() {
        let l = Layout::new(2, 4, 8, DType::BFloat16, 4)
            .unwrap()
            .with_storage(Storage::Fp8)
            .unwrap();
        assert_eq!(l.chunk_bytes(), 4 * 4 * 8 + 4 * 4);
        assert_eq!(l.block_bytes(), 2 * 2 * l.chunk_bytes());
        assert_eq!(l.kv_bytes(8), Some(2 * 2 * 2 * l.chunk_bytes()));
        assert_eq!(l.kv_bytes(6), None);
        // Block 1 of a 3-block buffer: run r at r * 3 chunks + 1 chunk.
        let buf: Vec<u8> = (0..l.kv_bytes(12).unwrap())
            .map(|i| (i / 7) as u8)
            .collect();
        let runs = l.block_runs(&buf, 12, 1);
        assert_eq!(runs.len(), 4);
        for (r, run) in runs.iter().enumerate() {
            let at = (3 * r + 1) * l.chunk_bytes();
            assert_eq!(*run, &buf[at..at + l.chunk_bytes()]);
        }
        assert!(Layout::new(2, 4, 8, DType::Float8E4M3, 4)
            .unwrap()
            .with_storage(Storage::Fp8)
            .is_err());
        assert_ne!(
            l.canonical_bytes(),
            l.with_storage(Storage::Exact).unwrap().canonical_bytes()
        );
    }

    #[test]
    fn latent_layouts() {
        let l = Layout::latent(3, 576, DType::BFloat16, 16).unwrap();
        assert_eq!((l.num_kv_heads, l.head_dim, l.kind), (1, 288, Kind::Latent));
        assert_eq!(l.latent_width(), Some(576));
        // The latent once per token and layer.
        assert_eq!(l.block_bytes(), 3 * 16 * 576 * 2);
        let kv = Layout::new(3, 1, 288, DType::BFloat16, 16).unwrap();
        assert_eq!(kv.latent_width(), None);
        assert_eq!(kv.block_bytes(), l.block_bytes());
        assert_ne!(kv.canonical_bytes(), l.canonical_bytes());
        assert!(Layout::latent(3, 575, DType::BFloat16, 16).is_err());
        assert!(Layout::latent(3, 0, DType::BFloat16, 16).is_err());
        for k in [Kind::KeyValue, Kind::Latent] {
            assert_eq!(Kind::parse(k.name()).unwrap(), k);
        }
        assert!(Kind::parse("mla").is_err());
    }

    #[test]
    fn rejects_zero_and_huge() {
        assert!(matches!(
            Layout::new(0, 8, 128, DType::Float16, 16),
            Err(Error::InvalidInput(_))
        ));
        assert!(matches!(
            Layout::new(1 << 20, 1 << 10, 1 << 10, DType::Float32, 16),
            Err(Error::InvalidInput(_))
        ));
    }

    #[test]
    fn dtype_names_round_trip() {
        for d in [
            DType::Float16,
            DType::BFloat16,
            DType::Float32,
            DType::Float8E4M3,
        ] {
            assert_eq!(DType::parse(d.name()).unwrap(), d);
        }
        assert!(DType::parse("int8").is_err());
    }
}
