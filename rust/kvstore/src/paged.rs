//! A serving engine's paged KV cache (vLLM's): where each value of a block
//! lies in the engine's per-layer caches, and the copies between there and a
//! block's canonical `[B, H, D]` runs. The geometry is learnt by the caller
//! from the engine's own cache writer; here it is only checked and followed.

use crate::arena::{RunReader, LANES};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::os::Rows;

/// Where K or V of one block lies inside a layer's paged cache, in elements
/// from the first element of the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedPart {
    /// Element offset of token 0, head 0, dim 0.
    pub offset: usize,
    /// Element strides of the token, head and dim axes.
    pub strides: [usize; 3],
}

impl PagedPart {
    /// Elements from a cache block's start to one past the part's last
    /// value (`None` on overflow).
    fn end(&self, layout: &Layout) -> Option<usize> {
        let dims = dims(layout);
        (0..3)
            .try_fold(self.offset, |at, a| {
                (dims[a] - 1).checked_mul(self.strides[a])?.checked_add(at)
            })?
            .checked_add(1)
    }
}

/// The geometry of a paged cache, the same in every layer: cache block `n`
/// starts `n * block_stride` elements into the layer's memory, K and V of it
/// are `parts[0]` and `parts[1]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedLayout {
    /// Elements from one cache block to the next.
    pub block_stride: usize,
    /// K, then V.
    pub parts: [PagedPart; 2],
}

impl PagedLayout {
    /// Checks that `layers` (one span per layer, `L` of them, each the layer's
    /// whole cache memory) hold cache blocks `blocks` entirely: every value a
    /// copy will touch is inside its layer's span.
    pub(crate) fn check(&self, layout: &Layout, spans: &[usize], blocks: &[usize]) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidInput(format!("paged cache: {why}")));
        if spans.len() != layout.num_layers as usize {
            return bad(format!(
                "expected {} layers, got {}",
                layout.num_layers,
                spans.len()
            ));
        }
        let Some(&last) = blocks.iter().max() else {
            return Ok(());
        };
        let need = self
            .extent(layout)
            .and_then(|e| last.checked_mul(self.block_stride)?.checked_add(e))
            .and_then(|e| e.checked_mul(layout.dtype.size()));
        match (need, spans.iter().min()) {
            (Some(need), Some(&have)) if need <= have => Ok(()),
            (Some(need), Some(&have)) => bad(format!(
                "cache block {last} needs {need} bytes of each layer, the smallest layer \
                 has {have}"
            )),
            _ => bad(format!(
                "cache block {last} lies past any layer's bytes (its offset overflows)"
            )),
        }
    }

    /// Elements from a cache block's start to one past the last value of
    /// its K or V (`None` on overflow).
    fn extent(&self, layout: &Layout) -> Option<usize> {
        self.parts
            .iter()
            .try_fold(0usize, |end, p| Some(end.max(p.end(layout)?)))
    }

    /// Cuts `layers` (which `check` passed for `blocks`) into each cache
    /// block's own bytes: for `blocks[k]`, one span per layer starting at the
    /// block's first element, so that blocks are written apart (by several
    /// threads, `scatter` with block 0). `None` where that cannot be: a
    /// block's K or V reach past its `block_stride` (another block's bytes),
    /// or a cache block is named twice.
    pub(crate) fn block_spans<'a>(
        &self,
        layout: &Layout,
        layers: &'a mut [&mut [u8]],
        blocks: &[usize],
    ) -> Option<Vec<Vec<&'a mut [u8]>>> {
        if self.extent(layout)? > self.block_stride {
            return None;
        }
        let mut order: Vec<usize> = (0..blocks.len()).collect();
        order.sort_unstable_by_key(|&k| blocks[k]);
        if order.windows(2).any(|w| blocks[w[0]] == blocks[w[1]]) {
            return None;
        }
        let stride = self.block_stride * layout.dtype.size();
        let mut out: Vec<Vec<&mut [u8]>> = blocks.iter().map(|_| Vec::new()).collect();
        for layer in layers.iter_mut() {
            // `rest` starts at byte `at` of the layer.
            let (mut rest, mut at): (&mut [u8], usize) = (&mut **layer, 0);
            for &k in &order {
                let from = blocks[k] * stride;
                let tail = std::mem::take(&mut rest).get_mut(from - at..)?;
                let (mine, after) = tail.split_at_mut(stride.min(tail.len()));
                at = from + mine.len();
                out[k].push(mine);
                rest = after;
            }
        }
        Some(out)
    }

    /// Copies block `runs` (the canonical `2L` `[B, H, D]` runs of one block)
    /// into cache block `block` of `layers`. `check` must have passed for it.
    /// The runs are only read: a scratch block's (`&mut`) or a buffer's.
    pub(crate) fn scatter<R: AsRef<[u8]>>(
        &self,
        layout: &Layout,
        runs: &[R],
        layers: &mut [&mut [u8]],
        block: usize,
    ) {
        for (r, run) in runs.iter().enumerate() {
            self.scatter_run(layout, r, run.as_ref(), layers, block);
        }
    }

    /// `scatter` of one run: run `r` (layer `r / 2`, K or V as `r` is even
    /// or odd, the order of `Layout::block_runs`) of a block into cache
    /// block `block` of `layers`. `check` must have passed for it.
    pub(crate) fn scatter_run(
        &self,
        layout: &Layout,
        r: usize,
        run: &[u8],
        layers: &mut [&mut [u8]],
        block: usize,
    ) {
        let part = &self.parts[r % 2];
        let at = block * self.block_stride + part.offset;
        copy(layout, part, Move::Into(&mut *layers[r / 2], at, run));
    }

    /// Lands a hot-tier block, whose runs `reader` reads in order
    /// (`Arena::read_runs`), in cache block `block` of `layers` (`check`
    /// must have passed for it). A part whose `D` values lie together in
    /// the cache (V on vLLM's CPU backend) goes straight from the slot, its
    /// rows streamed out in the pass that reads them, as a memcpy would; a
    /// part laid out otherwise (K there, transposed) goes through `pieces`
    /// (`LANES` runs, in the CPU's cache), then `scatter_run`.
    pub(crate) fn land(
        &self,
        layout: &Layout,
        reader: &mut RunReader<'_>,
        layers: &mut [&mut [u8]],
        block: usize,
        pieces: &mut [u8],
    ) {
        let (run, e) = (layout.chunk_bytes(), layout.dtype.size());
        let ([_, heads], row) = reader.shape();
        let runs = 2 * layers.len();
        assert_eq!(pieces.len(), LANES * run, "land: one piece per lane");
        let direct = self
            .parts
            .map(|p| p.strides[2] == 1 || layout.head_dim == 1);
        for g in (0..runs).step_by(LANES) {
            let n = LANES.min(runs - g);
            let mut outs: [Rows<'_>; LANES] = std::array::from_fn(|_| Rows {
                dst: &mut [],
                at: 0,
                strides: [0, 0],
                stream: false,
            });
            let mut through = [false; LANES];
            let mut chunks = pieces.chunks_exact_mut(run);
            for (i, layer) in layers[g / 2..].iter_mut().take(n / 2).enumerate() {
                let spans = self.part_spans(layout, layer, block, direct);
                for (kv, span) in spans.into_iter().enumerate() {
                    let j = 2 * i + kv;
                    let chunk = chunks.next().expect("a piece per lane");
                    outs[j] = if let Some((dst, at)) = span {
                        let s = self.parts[kv].strides;
                        Rows {
                            dst,
                            at,
                            strides: [s[0] * e, s[1] * e],
                            stream: true,
                        }
                    } else {
                        through[j] = true;
                        Rows {
                            dst: chunk,
                            at: 0,
                            strides: [heads * row, row],
                            stream: false,
                        }
                    };
                }
            }
            reader.read(&mut outs[..n]);
            for j in (0..n).filter(|&j| through[j]) {
                let piece = &pieces[j * run..(j + 1) * run];
                self.scatter_run(layout, g + j, piece, layers, block);
            }
        }
        crate::os::stream_fence();
    }

    /// The bytes of `layer` that K and V of cache block `block` may be
    /// written through, each with the byte offset of its first value
    /// there, for the parts `want`ed: the whole layer for one, and for both
    /// the layer cut between them where their extents do not overlap (else
    /// only V's). `None` for a part not given.
    #[allow(clippy::type_complexity)]
    fn part_spans<'a>(
        &self,
        layout: &Layout,
        layer: &'a mut [u8],
        block: usize,
        want: [bool; 2],
    ) -> [Option<(&'a mut [u8], usize)>; 2] {
        let e = layout.dtype.size();
        let start = |p: &PagedPart| (block * self.block_stride + p.offset) * e;
        let [k, v] = &self.parts;
        match want {
            [true, true] => {
                // `check` passed: no part's end overflows.
                let end = |p: &PagedPart| p.end(layout).expect("checked");
                let (end_k, end_v) = (end(k), end(v));
                let (sk, sv) = (start(k), start(v));
                let (ek, ev) = (
                    (block * self.block_stride + end_k) * e,
                    (block * self.block_stride + end_v) * e,
                );
                if ek <= sv {
                    let (a, b) = layer.split_at_mut(sv);
                    [Some((a, sk)), Some((b, 0))]
                } else if ev <= sk {
                    let (a, b) = layer.split_at_mut(sk);
                    [Some((b, 0)), Some((a, sv))]
                } else {
                    [None, Some((layer, sv))]
                }
            }
            [true, false] => [Some((layer, start(k))), None],
            [false, true] => [None, Some((layer, start(v)))],
            [false, false] => [None, None],
        }
    }

    /// Copies cache block `block` of `layers` into `runs` (a block's canonical
    /// runs). `check` must have passed for it.
    pub(crate) fn gather(
        &self,
        layout: &Layout,
        layers: &[&[u8]],
        block: usize,
        runs: &mut [&mut [u8]],
    ) {
        for (l, layer) in layers.iter().enumerate() {
            for (kv, part) in self.parts.iter().enumerate() {
                let at = block * self.block_stride + part.offset;
                copy(layout, part, Move::OutOf(layer, at, runs[2 * l + kv]));
            }
        }
    }
}

/// `[B, H, D]`.
fn dims(layout: &Layout) -> [usize; 3] {
    [
        layout.block_size as usize,
        layout.num_kv_heads as usize,
        layout.head_dim as usize,
    ]
}

/// Element strides of a contiguous `[B, H, D]` run.
fn canonical_strides(layout: &Layout) -> [usize; 3] {
    let [_, h, d] = dims(layout);
    [h * d, d, 1]
}

/// One direction of a copy between a paged part (its layer's memory and
/// the part's first element there) and a canonical run (the third field).
enum Move<'a> {
    Into(&'a mut [u8], usize, &'a [u8]),
    OutOf(&'a [u8], usize, &'a mut [u8]),
}

/// Copies one `[B, H, D]` part between the paged side and the canonical
/// run, walking the axes in the paged side's order (largest stride
/// outermost): a paged cache is the memory not in the CPU's cache, so it is
/// read or written in order, while the run (a hot-tier read's piece,
/// or one block's scratch) stays in cache.
fn copy(layout: &Layout, part: &PagedPart, paged: Move<'_>) {
    match layout.dtype.size() {
        1 => copy_sized::<1>(layout, part, paged),
        2 => copy_sized::<2>(layout, part, paged),
        4 => copy_sized::<4>(layout, part, paged),
        n => unreachable!("no dtype has {n}-byte elements"),
    }
}

fn copy_sized<const E: usize>(layout: &Layout, part: &PagedPart, mut paged: Move<'_>) {
    let dims = dims(layout);
    let cs = canonical_strides(layout);
    let ps = part.strides;
    // A transpose where the paged side's contiguous axis is not the
    // canonical one (K on vLLM's CPU backend: tokens contiguous): in tiles.
    let unit = (0..3).find(|&a| ps[a] == 1 && dims[a] > 1);
    if let Some(pa) = unit.filter(|&pa| pa != 2 && dims[2] > 1) {
        let o = 3 - pa - 2; // the third axis
        for x in 0..dims[o] {
            match &mut paged {
                Move::Into(dst, at, canon) => transpose::<E>(
                    (dst, *at + x * ps[o], ps[2]),
                    (canon, x * cs[o], cs[pa]),
                    dims[2],
                    dims[pa],
                    true,
                ),
                Move::OutOf(src, at, canon) => transpose::<E>(
                    (canon, x * cs[o], cs[pa]),
                    (src, *at + x * ps[o], ps[2]),
                    dims[pa],
                    dims[2],
                    false,
                ),
            }
        }
        crate::os::stream_fence();
        return;
    }
    let mut order = [0, 1, 2];
    order.sort_by_key(|&a| std::cmp::Reverse(ps[a]));
    let [o0, o1, a] = order;
    for i in 0..dims[o0] {
        for j in 0..dims[o1] {
            let p = i * ps[o0] + j * ps[o1];
            let c = i * cs[o0] + j * cs[o1];
            match &mut paged {
                // Contiguous on both sides (V on vLLM's CPU backend: a
                // head's row of D values): streamed into the cache.
                Move::Into(dst, at, canon) if ps[a] == 1 && cs[a] == 1 => {
                    let (d, n) = ((*at + p) * E, dims[a] * E);
                    crate::os::stream_copy(&mut dst[d..d + n], &canon[c * E..c * E + n]);
                }
                Move::Into(dst, at, canon) => {
                    row::<E>(dst, *at + p, ps[a], canon, c, cs[a], dims[a]);
                }
                Move::OutOf(src, at, canon) => {
                    row::<E>(canon, c, cs[a], src, *at + p, ps[a], dims[a]);
                }
            }
        }
    }
    crate::os::stream_fence();
}

/// Rows of `transpose_strips`'s strips (columns of the source read at once).
const TILE: usize = 8;
/// Columns of `transpose_strips`'s strips: a dst row of 64 two-byte elements
/// is two whole cache lines, written at once.
const STRIP: usize = 64;
/// Columns of `transpose_tiles`'s streamed rows: 4 tiles of two-byte
/// elements, one 64-byte cache line of each `dst` row.
const LINE: usize = 4 * TILE;
/// Columns of `transpose_tiles`'s rows written from registers (AVX2): two
/// tiles, 32 bytes of each `dst` row.
const WIDE: usize = 2 * TILE;

/// Copies an `n × m` matrix of `E`-byte elements whose rows are contiguous
/// in `dst` and whose columns are contiguous in `src`: element `(i, j)` from
/// `src` element `s + j * ss + i` to `dst` element `d + i * ds + j`. Two-byte
/// elements (bfloat16, float16: every cache vLLM's CPU backend keeps
/// unquantized but float32) go in SIMD tiles, the others in strips;
/// `stream`: `dst` is a paged cache (main memory) written with streaming
/// stores where it can be (`crate::os::stream_copy`; the caller fences).
fn transpose<const E: usize>(
    dst: (&mut [u8], usize, usize),
    src: (&[u8], usize, usize),
    n: usize,
    m: usize,
    stream: bool,
) {
    if E == 2 {
        transpose_tiles(dst, src, n, m, stream);
    } else {
        transpose_strips::<E>(dst, src, n, m);
    }
}

/// `transpose` of two-byte elements in 8x8 tiles, each 8 loads and 8 stores
/// of 16 bytes; tiles in row order, so that `dst` (the paged cache, in main
/// memory, on a load) is written a whole row of tiles at a time. The rows
/// and columns past the last whole tile go element by element. With
/// `stream`, each `LINE` columns of a row of tiles are transposed into a
/// staging block in the CPU's cache, then streamed out a whole `dst` line
/// per row, so that no line of `dst` is read before it is written; or,
/// where `wide_rows` says so, each `WIDE` columns go from registers to
/// `dst` in one streaming store per row (`os::transpose_16x8_u16_stream`).
fn transpose_tiles(
    (dst, d, ds): (&mut [u8], usize, usize),
    (src, s, ss): (&[u8], usize, usize),
    n: usize,
    m: usize,
    stream: bool,
) {
    let (tn, tm) = (n / TILE * TILE, m / TILE * TILE);
    // With AVX2 and `dst` rows on 32-byte boundaries, 16 columns of a row
    // of tiles go from registers to `dst` at once (`wide`); else whole
    // lines through the staging block.
    let wide = if stream && wide_rows(dst, d, ds) {
        m / WIDE * WIDE
    } else {
        0
    };
    let lines = if stream && wide == 0 {
        m / LINE * LINE
    } else {
        wide
    };
    let mut stage = [0u8; TILE * LINE * 2];
    for i0 in (0..tn).step_by(TILE) {
        #[cfg(target_arch = "x86_64")]
        for j0 in (0..wide).step_by(WIDE) {
            crate::os::transpose_16x8_u16_stream(
                (dst, (d + i0 * ds + j0) * 2, ds * 2),
                (src, (s + j0 * ss + i0) * 2, ss * 2),
            );
        }
        for j0 in (wide..lines).step_by(LINE) {
            for t in 0..LINE / TILE {
                let from = (s + (j0 + t * TILE) * ss + i0) * 2;
                tile_8x8_u16((&mut stage, t * TILE * 2, LINE * 2), (src, from, ss * 2));
            }
            for (i, row) in stage.chunks_exact(LINE * 2).enumerate() {
                let at = (d + (i0 + i) * ds + j0) * 2;
                crate::os::stream_copy(&mut dst[at..at + LINE * 2], row);
            }
        }
        for j0 in (lines..tm).step_by(TILE) {
            tile_8x8_u16(
                (dst, (d + i0 * ds + j0) * 2, ds * 2),
                (src, (s + j0 * ss + i0) * 2, ss * 2),
            );
        }
        for i in (i0..i0 + TILE).filter(|_| tm < m) {
            row::<2>(dst, d + i * ds + tm, 1, src, s + tm * ss + i, ss, m - tm);
        }
    }
    for i in tn..n {
        row::<2>(dst, d + i * ds, 1, src, s + i, ss, m);
    }
}

/// Whether `transpose_tiles` may write `dst`'s rows (two-byte elements
/// from element `d`, `ds` apart) `WIDE` columns at a time: AVX2, and every
/// row on a 32-byte boundary.
fn wide_rows(dst: &[u8], d: usize, ds: usize) -> bool {
    let first = (dst.as_ptr() as usize).wrapping_add(2 * d);
    crate::os::has_wide_transpose() && first.is_multiple_of(32) && (2 * ds).is_multiple_of(32)
}

/// An 8x8 tile of 2-byte elements, byte offsets and strides: the 16 bytes
/// of `src`'s row `j` are element `j` of each of `dst`'s 8 rows.
#[inline]
fn tile_8x8_u16(dst: (&mut [u8], usize, usize), src: (&[u8], usize, usize)) {
    #[cfg(target_arch = "x86_64")]
    {
        crate::os::transpose_8x8_u16(dst, src);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let ((dst, d, ds), (src, s, ss)) = (dst, src);
        for j in 0..TILE {
            for i in 0..TILE {
                let (to, from) = (d + i * ds + 2 * j, s + j * ss + 2 * i);
                dst[to..to + 2].copy_from_slice(&src[from..from + 2]);
            }
        }
    }
}

/// `transpose` in strips of `TILE` rows: `TILE` elements of each column
/// read at once, then each row of the strip written whole, so that `dst` is
/// written in whole cache lines, in order.
fn transpose_strips<const E: usize>(
    (dst, d, ds): (&mut [u8], usize, usize),
    (src, s, ss): (&[u8], usize, usize),
    n: usize,
    m: usize,
) {
    let tn = n / TILE * TILE;
    let mut cols = [[[0u8; E]; TILE]; STRIP];
    for i0 in (0..tn).step_by(TILE) {
        for j0 in (0..m).step_by(STRIP) {
            let w = STRIP.min(m - j0);
            for (jj, col) in cols[..w].iter_mut().enumerate() {
                let at = (s + (j0 + jj) * ss + i0) * E;
                let (elems, _) = src[at..at + TILE * E].as_chunks::<E>();
                *col = elems.try_into().expect("a strip's column");
            }
            for ii in 0..TILE {
                let at = (d + (i0 + ii) * ds + j0) * E;
                let (out, _) = dst[at..at + w * E].as_chunks_mut::<E>();
                for (o, col) in out.iter_mut().zip(&cols) {
                    *o = col[ii];
                }
            }
        }
    }
    // The rows past the last whole strip.
    for i in tn..n {
        row::<E>(dst, d + i * ds, 1, src, s + i, ss, m);
    }
}

/// Copies `n` elements of `E` bytes, element `k` from `src`'s element
/// `s + k * ss` to `dst`'s `d + k * ds`; a slice copy where both are
/// contiguous, else element by element as `[u8; E]` moves (not a `memcpy`
/// call each), iterating the contiguous side.
fn row<const E: usize>(
    dst: &mut [u8],
    d: usize,
    ds: usize,
    src: &[u8],
    s: usize,
    ss: usize,
    n: usize,
) {
    let elem = |bytes: &[u8], at: usize| -> [u8; E] {
        bytes[at * E..at * E + E].try_into().expect("E bytes")
    };
    let put = |bytes: &mut [u8], at: usize, v: [u8; E]| {
        let o: &mut [u8; E] = (&mut bytes[at * E..at * E + E])
            .try_into()
            .expect("E bytes");
        *o = v;
    };
    match (ds, ss) {
        (1, 1) => dst[d * E..(d + n) * E].copy_from_slice(&src[s * E..(s + n) * E]),
        (1, _) => {
            let (out, _) = dst[d * E..(d + n) * E].as_chunks_mut::<E>();
            for (k, o) in out.iter_mut().enumerate() {
                *o = elem(src, s + k * ss);
            }
        }
        (_, 1) => {
            let (vals, _) = src[s * E..(s + n) * E].as_chunks::<E>();
            for (k, v) in vals.iter().enumerate() {
                put(dst, d + k * ds, *v);
            }
        }
        _ => {
            for k in 0..n {
                put(dst, d + k * ds, elem(src, s + k * ss));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::DType;

    /// `transpose`'s contract, element by element: the reference.
    fn transpose_model<const E: usize>(
        (dst, d, ds): (&mut [u8], usize, usize),
        (src, s, ss): (&[u8], usize, usize),
        n: usize,
        m: usize,
    ) {
        for i in 0..n {
            for j in 0..m {
                let (to, from) = ((d + i * ds + j) * E, (s + j * ss + i) * E);
                dst[to..to + E].copy_from_slice(&src[from..from + E]);
            }
        }
    }

    fn transposes_like_the_model<const E: usize>() {
        let sizes = [1, 2, 3, 7, 8, 9, 15, 16, 17, 32, 33, 64, 70];
        for &n in &sizes {
            for &m in &sizes {
                // Padded strides and offsets: nothing but the matrix is
                // touched; and rows exactly `m` long, back to back.
                for ds in [m + 3, m] {
                    let (s, ss, d) = (3, n + 5, 1);
                    let src: Vec<u8> = (0..(s + m * ss) * E)
                        .map(|i| (i * 131 + i / 251) as u8)
                        .collect();
                    let mut want = vec![0xA5u8; (d + n * ds) * E];
                    let got = want.clone();
                    transpose_model::<E>((&mut want, d, ds), (&src, s, ss), n, m);
                    for stream in [false, true] {
                        let mut got = got.clone();
                        transpose::<E>((&mut got, d, ds), (&src, s, ss), n, m, stream);
                        assert!(
                            got == want,
                            "E {E}, {n} x {m}, row stride {ds}, stream {stream}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn transposes_every_element_size_and_odd_shape_like_the_model() {
        transposes_like_the_model::<1>();
        transposes_like_the_model::<2>();
        transposes_like_the_model::<4>();
    }

    /// Streamed transposes of two-byte elements into `dst` rows that start
    /// on `align`-byte boundaries, padded and back to back, like the model.
    fn aligned_rows_transpose_like_the_model(align: usize, shapes: &[(usize, usize)]) {
        let per = align / 2; // elements
        for &(n, m) in shapes {
            for ds in [m.next_multiple_of(per) + per, m.next_multiple_of(per)] {
                let (s, ss) = (5, n + 3);
                let src: Vec<u8> = (0..(s + m * ss) * 2)
                    .map(|i| (i * 37 + i / 7) as u8)
                    .collect();
                let mut want = vec![0x5Au8; (per + n * ds) * 2];
                let mut got = want.clone();
                let d = (align - got.as_ptr() as usize % align) % align / 2;
                assert!((got.as_ptr() as usize + 2 * d).is_multiple_of(align));
                transpose_model::<2>((&mut want, d, ds), (&src, s, ss), n, m);
                transpose::<2>((&mut got, d, ds), (&src, s, ss), n, m, true);
                crate::os::stream_fence();
                assert!(got == want, "{n} x {m}, row stride {ds}, {align}-byte rows");
            }
        }
    }

    #[test]
    fn streamed_rows_on_16_byte_boundaries_transpose_like_the_model() {
        // `dst` rows 16-byte aligned, so that whole lines go through the
        // streaming stores (elsewhere they fall back to plain ones); rows of
        // whole lines back to back are vLLM's 32-token blocks of K.
        let shapes = [(8, 32), (64, 32), (16, 64), (64, 40), (9, 33), (24, 96)];
        aligned_rows_transpose_like_the_model(16, &shapes);
    }

    #[test]
    fn rows_on_32_byte_boundaries_transpose_like_the_model() {
        // `dst` rows 32-byte aligned: with AVX2, 16 columns at a time from
        // registers (`WIDE`), the columns past the last 16 in tiles and
        // element by element.
        let probe = vec![0u8; 64];
        let d = (32 - probe.as_ptr() as usize % 32) % 32 / 2;
        assert!(
            wide_rows(&probe, d, 16) || !cfg!(target_arch = "x86_64"),
            "an x86-64 CPU without AVX2: this test would not reach the wide path"
        );
        let shapes = [
            (8, 16),
            (64, 32),
            (64, 48),
            (16, 40),
            (9, 33),
            (24, 96),
            (64, 17),
        ];
        aligned_rows_transpose_like_the_model(32, &shapes);
    }

    #[test]
    fn stream_copy_copies_aligned_and_unaligned() {
        let src: Vec<u8> = (0..300).map(|i| (i * 13) as u8).collect();
        let mut dst = vec![0u8; 340];
        let a = (16 - dst.as_ptr() as usize % 16) % 16;
        for (at, len) in [(a, 256), (a + 16, 128), (a + 1, 256), (a, 100), (a, 0)] {
            dst.fill(0);
            crate::os::stream_copy(&mut dst[at..at + len], &src[..len]);
            crate::os::stream_fence();
            assert_eq!(&dst[at..at + len], &src[..len]);
            assert!(dst[..at].iter().chain(&dst[at + len..]).all(|&b| b == 0));
        }
    }

    #[test]
    fn a_tile_transposes() {
        // Rows 40 bytes apart in `src`, 24 in `dst`, from offsets 3 and 5.
        let src: Vec<u8> = (0..3 + 7 * 40 + 16).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0xA5u8; 5 + 7 * 24 + 16];
        tile_8x8_u16((&mut dst, 5, 24), (&src, 3, 40));
        let mut want = vec![0xA5u8; dst.len()];
        for j in 0..TILE {
            for i in 0..TILE {
                let (to, from) = (5 + i * 24 + 2 * j, 3 + j * 40 + 2 * i);
                want[to..to + 2].copy_from_slice(&src[from..from + 2]);
            }
        }
        assert!(dst == want);
    }

    fn layout(b: u32) -> Layout {
        Layout::new(2, 2, 4, DType::Float16, b).unwrap()
    }

    /// vLLM's CPU layout for `layout(b)`: K `[H][D][B]`, V `[H][B][D]`, then
    /// `pad` elements.
    fn cpu(b: usize, pad: usize) -> PagedLayout {
        let (h, d) = (2, 4);
        PagedLayout {
            block_stride: 2 * b * h * d + pad,
            parts: [
                PagedPart {
                    offset: 0,
                    strides: [1, d * b, b],
                },
                PagedPart {
                    offset: b * h * d,
                    strides: [d, b * d, 1],
                },
            ],
        }
    }

    #[test]
    fn block_spans_are_each_blocks_own_bytes() {
        let (l, p) = (layout(4), cpu(4, 3));
        let sb = p.block_stride * 2;
        // Layer 1 ends with block 5's K and V (64 elements), without its padding.
        let mut caches = [vec![0u8; 6 * sb], vec![0u8; 5 * sb + 128]];
        let base: Vec<usize> = caches.iter().map(|c| c.as_ptr() as usize).collect();
        let mut layers: Vec<&mut [u8]> = caches.iter_mut().map(|c| &mut c[..]).collect();
        let blocks = [5, 0, 3];
        p.check(&l, &[6 * sb, 5 * sb + 128], &blocks).unwrap();
        let spans = p.block_spans(&l, &mut layers, &blocks).unwrap();
        for (k, per_layer) in spans.iter().enumerate() {
            assert_eq!(per_layer.len(), 2);
            for (layer, span) in per_layer.iter().enumerate() {
                assert_eq!(span.as_ptr() as usize - base[layer], blocks[k] * sb);
                // The last block of the short layer ends with the layer.
                let len = if (layer, blocks[k]) == (1, 5) {
                    128
                } else {
                    sb
                };
                assert_eq!(span.len(), len, "block {} layer {layer}", blocks[k]);
            }
        }
    }

    #[test]
    fn block_spans_refuse_parts_outside_their_block_and_repeated_blocks() {
        let l = layout(4);
        let mut caches = [vec![0u8; 4096], vec![0u8; 4096]];
        let mut layers: Vec<&mut [u8]> = caches.iter_mut().map(|c| &mut c[..]).collect();
        assert!(cpu(4, 0).block_spans(&l, &mut layers, &[1, 2]).is_some());
        assert!(cpu(4, 0).block_spans(&l, &mut layers, &[1, 2, 1]).is_none());
        // K of every block, then V of every block (a GPU backend's
        // `[2, blocks, B, H, D]`): V lies past the block's stride.
        let split = PagedLayout {
            block_stride: 4 * 2 * 4,
            parts: [
                PagedPart {
                    offset: 0,
                    strides: [8, 4, 1],
                },
                PagedPart {
                    offset: 8 * 32,
                    strides: [8, 4, 1],
                },
            ],
        };
        assert!(split.block_spans(&l, &mut layers, &[1, 2]).is_none());
        // One element past the stride is one too many.
        let mut tight = cpu(4, 0);
        tight.block_stride -= 1;
        assert!(tight.block_spans(&l, &mut layers, &[1]).is_none());
    }
}
