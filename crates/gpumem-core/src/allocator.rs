//! A model of PyTorch 2.x's native CUDA caching allocator (`CUDACachingAllocator.cpp`), exact to
//! the byte for the rules in ../shared/docs/pytorch-memory-spec.md §1.
//!
//! [`CachingAllocator`] serves `malloc`/`free` requests the way PyTorch does: 512-byte rounding
//! (optionally power-of-two divisions), a small pool (≤ 1 MiB) carved from 2 MiB segments and a
//! large pool carved from 20 MiB or 2-MiB-rounded segments, best fit by (stream, size, address),
//! splitting and coalescing, `max_split_size`, expandable segments, and the out-of-memory path
//! (free cached segments, retry, then fail). Addresses are virtual: each segment gets a fresh
//! base, so ties between equal-sized free blocks break by creation order, as they do on a GPU
//! that hands out increasing addresses.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::units::MIB;

pub const MIN_BLOCK_SIZE: u64 = 512;
pub const SMALL_SIZE: u64 = MIB;
pub const SMALL_BUFFER: u64 = 2 * MIB;
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
pub const LARGE_BUFFER: u64 = 20 * MIB;
pub const ROUND_LARGE: u64 = 2 * MIB;
const NONE: u32 = u32::MAX;
/// Virtual address space given to each segment; large enough that segments never overlap.
const SEGMENT_STRIDE: u64 = 1 << 46;

/// Allocator options, as `PYTORCH_CUDA_ALLOC_CONF` sets them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorConfig {
    /// Blocks at least this large are never split (`max_split_size_mb`); `u64::MAX` = unlimited.
    pub max_split_size: u64,
    /// Per-interval `roundup_power2_divisions` (index `floor(log2(size)) - 20`, clamped to 0..=15).
    pub roundup_power2_divisions: [u32; 16],
    pub expandable_segments: bool,
    /// Slack an oversize request may take from a cached oversize block (`max_non_split_rounding_mb`).
    pub max_non_split_rounding: u64,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            max_split_size: u64::MAX,
            roundup_power2_divisions: [0; 16],
            expandable_segments: false,
            max_non_split_rounding: LARGE_BUFFER,
        }
    }
}

/// A `PYTORCH_CUDA_ALLOC_CONF` string gpumem cannot read (as a profile's `allocator` field).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocatorConfigError {
    #[error("option `{0}` has no value")]
    NoValue(String),
    #[error("option {option}: missing `]`")]
    MissingBracket { option: String },
    #[error("option {option}: `{value}` is not a whole number")]
    NotWholeNumber { option: String, value: String },
    #[error("option max_split_size_mb: {0} is below the minimum of 20")]
    SplitSizeTooSmall(u64),
    #[error("option expandable_segments: `{0}` is not True or False")]
    NotBool(String),
    #[error("unknown allocator option `{0}`")]
    UnknownOption(String),
    #[error("option roundup_power2_divisions: {0}")]
    Divisions(DivisionsError),
}

/// What is wrong with a `roundup_power2_divisions` value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DivisionsError {
    #[error("{0} is not a power of two")]
    NotPowerOfTwo(u64),
    #[error("{0} is too large")]
    TooLarge(u64),
    #[error("`{0}` is not KEY:VALUE")]
    NotKeyValue(String),
    #[error("`{0}` is not a number")]
    NotNumber(String),
    #[error("key {0} is not a power of two")]
    KeyNotPowerOfTwo(u64),
}

impl AllocatorConfig {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string, e.g.
    /// `max_split_size_mb:128,roundup_power2_divisions:[256:4,>:8],expandable_segments:True`.
    pub fn parse(conf: &str) -> Result<Self, AllocatorConfigError> {
        let mut c = AllocatorConfig::default();
        let mut rest = conf.trim();
        while !rest.is_empty() {
            let (key, after) = rest
                .split_once(':')
                .ok_or_else(|| AllocatorConfigError::NoValue(rest.to_string()))?;
            let key = key.trim();
            let (value, next) = if after.starts_with('[') {
                let end = after
                    .find(']')
                    .ok_or_else(|| AllocatorConfigError::MissingBracket {
                        option: key.to_string(),
                    })?;
                (&after[..=end], after[end + 1..].trim_start_matches(','))
            } else {
                match after.split_once(',') {
                    Some((v, n)) => (v, n),
                    None => (after, ""),
                }
            };
            let value = value.trim();
            let num = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| AllocatorConfigError::NotWholeNumber {
                        option: key.to_string(),
                        value: v.to_string(),
                    })
            };
            match key {
                "max_split_size_mb" => {
                    let mb = num(value)?;
                    if mb < 20 {
                        return Err(AllocatorConfigError::SplitSizeTooSmall(mb));
                    }
                    c.max_split_size = mb * MIB;
                }
                "max_non_split_rounding_mb" => c.max_non_split_rounding = num(value)? * MIB,
                "expandable_segments" => {
                    c.expandable_segments = match value {
                        "True" | "true" | "1" => true,
                        "False" | "false" | "0" => false,
                        v => return Err(AllocatorConfigError::NotBool(v.to_string())),
                    }
                }
                "roundup_power2_divisions" => {
                    c.roundup_power2_divisions =
                        parse_divisions(value).map_err(AllocatorConfigError::Divisions)?
                }
                // Options that do not change how much memory is reserved.
                "garbage_collection_threshold" | "pinned_use_cuda_host_register" | "backend" => {}
                other => return Err(AllocatorConfigError::UnknownOption(other.to_string())),
            }
            rest = next.trim();
        }
        Ok(c)
    }

    fn divisions_for(&self, size: u64) -> u64 {
        let log2 = 63 - size.max(1).leading_zeros() as u64;
        self.roundup_power2_divisions[log2.saturating_sub(20).min(15) as usize] as u64
    }

    /// `round_size`: the block size PyTorch hands out for a request.
    pub fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK_SIZE {
            return MIN_BLOCK_SIZE;
        }
        let d = self.divisions_for(size);
        if d > 1 && size > MIN_BLOCK_SIZE * d {
            roundup_power2_next_division(size, d)
        } else {
            size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
        }
    }
}

fn parse_divisions(value: &str) -> Result<[u32; 16], DivisionsError> {
    let check = |d: u64| -> Result<u32, DivisionsError> {
        if d != 0 && !d.is_power_of_two() {
            return Err(DivisionsError::NotPowerOfTwo(d));
        }
        u32::try_from(d).map_err(|_| DivisionsError::TooLarge(d))
    };
    let mut out = [0u32; 16];
    if let Some(list) = value.strip_prefix('[').and_then(|v| v.strip_suffix(']')) {
        let mut last_index = 0usize;
        let mut first = true;
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item
                .split_once(':')
                .ok_or_else(|| DivisionsError::NotKeyValue(item.to_string()))?;
            let d = check(
                v.trim()
                    .parse()
                    .map_err(|_| DivisionsError::NotNumber(v.to_string()))?,
            )?;
            if k.trim() == ">" {
                for slot in out.iter_mut().skip(last_index + 1) {
                    *slot = d;
                }
                continue;
            }
            let mb: u64 = k
                .trim()
                .parse()
                .map_err(|_| DivisionsError::NotNumber(k.to_string()))?;
            if !mb.is_power_of_two() {
                return Err(DivisionsError::KeyNotPowerOfTwo(mb));
            }
            let index = (mb.trailing_zeros() as usize).min(15);
            if first {
                for slot in out.iter_mut().take(index) {
                    *slot = d;
                }
                first = false;
            }
            out[index] = d;
            last_index = index;
        }
    } else {
        let d = check(
            value
                .parse()
                .map_err(|_| DivisionsError::NotNumber(value.to_string()))?,
        )?;
        out = [d; 16];
    }
    Ok(out)
}

/// Rounds up to the next of `d` equal steps between two powers of two (PyTorch's rule).
fn roundup_power2_next_division(size: u64, d: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> (63 - d.leading_zeros());
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size { size } else { down + step }
}

/// The size of a new segment for a rounded request (`allocation_size`).
pub fn allocation_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pool {
    Small,
    Large,
}

#[derive(Debug, Clone)]
struct Block {
    segment: u32,
    addr: u64,
    size: u64,
    requested: u64,
    stream: u32,
    pool: Pool,
    allocated: bool,
    prev: u32,
    next: u32,
}

#[derive(Debug, Clone)]
struct Segment {
    base: u64,
    /// Bytes obtained from the driver (mapped bytes for an expandable segment).
    size: u64,
    stream: u32,
    pool: Pool,
    expandable: bool,
    /// First and last block in address order.
    head: u32,
    tail: u32,
    live: bool,
}

/// A handle to an allocated block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockId(u32);

/// The allocator could not serve a request even after releasing its cache.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "out of memory: tried to allocate {requested} bytes ({rounded} rounded); {reserved} reserved of {capacity} available"
)]
pub struct OutOfMemory {
    pub requested: u64,
    pub rounded: u64,
    pub reserved: u64,
    pub capacity: u64,
}

/// Counters as `torch.cuda.memory_stats()` keeps them (current and peak).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AllocatorStats {
    pub allocated: u64,
    pub reserved: u64,
    pub requested: u64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    pub peak_requested: u64,
    pub segments: u64,
    pub num_device_alloc: u64,
    pub num_device_free: u64,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
}

/// Free blocks ordered by (stream, size, address); the block index rides along.
type FreeSet = BTreeSet<(u32, u64, u64, u32)>;

/// The simulated allocator of one device.
#[derive(Debug, Clone)]
pub struct CachingAllocator {
    config: AllocatorConfig,
    /// Bytes the driver can give to this allocator (device total minus context and other users).
    capacity: u64,
    blocks: Vec<Block>,
    spare_blocks: Vec<u32>,
    segments: Vec<Segment>,
    small: FreeSet,
    large: FreeSet,
    stats: AllocatorStats,
}

impl CachingAllocator {
    pub fn new(config: AllocatorConfig, capacity: u64) -> Self {
        CachingAllocator {
            config,
            capacity,
            blocks: Vec::new(),
            spare_blocks: Vec::new(),
            segments: Vec::new(),
            small: FreeSet::new(),
            large: FreeSet::new(),
            stats: AllocatorStats::default(),
        }
    }

    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }
    pub fn stats(&self) -> &AllocatorStats {
        &self.stats
    }

    /// Size of an allocated block (what `memory_allocated` counts for it).
    pub fn block_size(&self, b: BlockId) -> u64 {
        self.blocks[b.0 as usize].size
    }

    fn pool_set(&mut self, pool: Pool) -> &mut FreeSet {
        match pool {
            Pool::Small => &mut self.small,
            Pool::Large => &mut self.large,
        }
    }

    fn key(&self, i: u32) -> (u32, u64, u64, u32) {
        let b = &self.blocks[i as usize];
        (b.stream, b.size, b.addr, i)
    }

    fn insert_free(&mut self, i: u32) {
        let key = self.key(i);
        let pool = self.blocks[i as usize].pool;
        self.pool_set(pool).insert(key);
    }

    fn remove_free(&mut self, i: u32) {
        let key = self.key(i);
        let pool = self.blocks[i as usize].pool;
        let removed = self.pool_set(pool).remove(&key);
        debug_assert!(removed, "block {i} was not in its pool");
    }

    fn new_block(&mut self, b: Block) -> u32 {
        match self.spare_blocks.pop() {
            Some(i) => {
                self.blocks[i as usize] = b;
                i
            }
            None => {
                self.blocks.push(b);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    /// `malloc`: serve a request of `request` bytes on `stream`.
    pub fn malloc(&mut self, request: u64, stream: u32) -> Result<BlockId, OutOfMemory> {
        let size = self.config.round_size(request);
        let pool = if size <= SMALL_SIZE {
            Pool::Small
        } else {
            Pool::Large
        };
        let alloc_size = allocation_size(size);
        let block = match self.get_free_block(stream, size, pool) {
            Some(b) => b,
            None => match self.grow_or_release(stream, size, alloc_size, pool) {
                Some(b) => b,
                None => {
                    self.stats.num_ooms += 1;
                    return Err(OutOfMemory {
                        requested: request,
                        rounded: size,
                        reserved: self.stats.reserved,
                        capacity: self.capacity,
                    });
                }
            },
        };
        Ok(BlockId(self.hand_out(block, size, request)))
    }

    /// §1.3 step 7: a new segment; else release oversize cached blocks and retry; else release
    /// every cached segment (an implicit `empty_cache`) and retry.
    fn grow_or_release(
        &mut self,
        stream: u32,
        size: u64,
        alloc_size: u64,
        pool: Pool,
    ) -> Option<u32> {
        if let Some(b) = self.grow(stream, size, alloc_size, pool) {
            return Some(b);
        }
        if self.release_available_cached_blocks(size, stream)
            && let Some(b) = self.grow(stream, size, alloc_size, pool)
        {
            return Some(b);
        }
        self.stats.num_alloc_retries += 1;
        self.release_cached_blocks();
        self.grow(stream, size, alloc_size, pool)
    }

    /// Best fit: the first free block ≥ (stream, size, 0); never across streams.
    fn get_free_block(&mut self, stream: u32, size: u64, pool: Pool) -> Option<u32> {
        let max_split = self.config.max_split_size;
        let rounding = self.config.max_non_split_rounding;
        let set = match pool {
            Pool::Small => &self.small,
            Pool::Large => &self.large,
        };
        let &(s, bsize, _, i) = set.range((stream, size, 0, 0)..).next()?;
        if s != stream {
            return None;
        }
        if max_split != u64::MAX {
            if size < max_split && bsize >= max_split {
                return None;
            }
            if size >= max_split && bsize >= size + rounding {
                return None;
            }
        }
        self.remove_free(i);
        Some(i)
    }

    /// Gets memory from the driver: a new segment, or more pages of an expandable one.
    /// Returns a free block (not in the pool) of at least `size` bytes.
    fn grow(&mut self, stream: u32, size: u64, alloc_size: u64, pool: Pool) -> Option<u32> {
        if self.config.expandable_segments {
            return self.grow_expandable(stream, size, pool);
        }
        if self.stats.reserved + alloc_size > self.capacity {
            return None;
        }
        let seg = self.segments.len() as u32;
        let base = seg as u64 * SEGMENT_STRIDE;
        let b = self.new_block(Block {
            segment: seg,
            addr: base,
            size: alloc_size,
            requested: 0,
            stream,
            pool,
            allocated: false,
            prev: NONE,
            next: NONE,
        });
        self.segments.push(Segment {
            base,
            size: alloc_size,
            stream,
            pool,
            expandable: false,
            head: b,
            tail: b,
            live: true,
        });
        self.note_reserved(alloc_size as i64);
        self.stats.segments += 1;
        self.stats.num_device_alloc += 1;
        Some(b)
    }

    fn grow_expandable(&mut self, stream: u32, size: u64, pool: Pool) -> Option<u32> {
        let page = if pool == Pool::Small {
            SMALL_BUFFER
        } else {
            LARGE_BUFFER
        };
        let seg = match self
            .segments
            .iter()
            .position(|s| s.live && s.expandable && s.stream == stream && s.pool == pool)
        {
            Some(i) => i as u32,
            None => {
                let i = self.segments.len() as u32;
                self.segments.push(Segment {
                    base: i as u64 * SEGMENT_STRIDE,
                    size: 0,
                    stream,
                    pool,
                    expandable: true,
                    head: NONE,
                    tail: NONE,
                    live: true,
                });
                self.stats.segments += 1;
                i
            }
        };
        let tail = self.segments[seg as usize].tail;
        let tail_free = tail != NONE && !self.blocks[tail as usize].allocated;
        let have = if tail_free {
            self.blocks[tail as usize].size
        } else {
            0
        };
        let map = (size - have).div_ceil(page) * page;
        if self.stats.reserved + map > self.capacity {
            return None;
        }
        self.note_reserved(map as i64);
        self.stats.num_device_alloc += 1;
        let s = &mut self.segments[seg as usize];
        let end = s.base + s.size;
        s.size += map;
        if tail_free {
            self.remove_free(tail);
            self.blocks[tail as usize].size += map;
            Some(tail)
        } else {
            let b = self.new_block(Block {
                segment: seg,
                addr: end,
                size: map,
                requested: 0,
                stream,
                pool,
                allocated: false,
                prev: tail,
                next: NONE,
            });
            if tail != NONE {
                self.blocks[tail as usize].next = b;
            } else {
                self.segments[seg as usize].head = b;
            }
            self.segments[seg as usize].tail = b;
            Some(b)
        }
    }

    fn should_split(&self, b: &Block, size: u64) -> bool {
        let remaining = b.size - size;
        if self.segments[b.segment as usize].expandable || b.pool == Pool::Small {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.config.max_split_size && remaining > SMALL_SIZE
        }
    }

    fn hand_out(&mut self, i: u32, size: u64, request: u64) -> u32 {
        if self.should_split(&self.blocks[i as usize], size) {
            let b = self.blocks[i as usize].clone();
            let rest = self.new_block(Block {
                segment: b.segment,
                addr: b.addr + size,
                size: b.size - size,
                requested: 0,
                stream: b.stream,
                pool: b.pool,
                allocated: false,
                prev: i,
                next: b.next,
            });
            if b.next != NONE {
                self.blocks[b.next as usize].prev = rest;
            } else {
                self.segments[b.segment as usize].tail = rest;
            }
            let blk = &mut self.blocks[i as usize];
            blk.size = size;
            blk.next = rest;
            self.insert_free(rest);
        }
        let blk = &mut self.blocks[i as usize];
        blk.allocated = true;
        blk.requested = request;
        let (bsize, req) = (blk.size, blk.requested);
        let st = &mut self.stats;
        st.allocated += bsize;
        st.requested += req;
        st.peak_allocated = st.peak_allocated.max(st.allocated);
        st.peak_requested = st.peak_requested.max(st.requested);
        i
    }

    /// `free`: return a block to its pool, merging it with free neighbours.
    pub fn free(&mut self, id: BlockId) {
        let mut i = id.0;
        let (size, req) = {
            let b = &mut self.blocks[i as usize];
            debug_assert!(b.allocated, "free of a block that is not allocated");
            b.allocated = false;
            (b.size, b.requested)
        };
        self.stats.allocated -= size;
        self.stats.requested -= req;
        let prev = self.blocks[i as usize].prev;
        if prev != NONE && !self.blocks[prev as usize].allocated {
            self.remove_free(prev);
            self.absorb_next(prev);
            i = prev;
        }
        let next = self.blocks[i as usize].next;
        if next != NONE && !self.blocks[next as usize].allocated {
            self.remove_free(next);
            self.absorb_next(i);
        }
        self.insert_free(i);
    }

    /// Merges block `i` with its (free, unpooled) successor.
    fn absorb_next(&mut self, i: u32) {
        let n = self.blocks[i as usize].next;
        let (nsize, nnext) = (self.blocks[n as usize].size, self.blocks[n as usize].next);
        let b = &mut self.blocks[i as usize];
        b.size += nsize;
        b.next = nnext;
        if nnext != NONE {
            self.blocks[nnext as usize].prev = i;
        } else {
            let seg = self.blocks[i as usize].segment;
            self.segments[seg as usize].tail = i;
        }
        self.spare_blocks.push(n);
    }

    fn note_reserved(&mut self, delta: i64) {
        let st = &mut self.stats;
        st.reserved = (st.reserved as i64 + delta) as u64;
        st.peak_reserved = st.peak_reserved.max(st.reserved);
    }

    /// Gives a whole free segment back to the driver.
    fn release_segment_of(&mut self, i: u32) {
        let b = self.blocks[i as usize].clone();
        debug_assert!(!b.allocated && b.prev == NONE && b.next == NONE);
        self.remove_free(i);
        self.spare_blocks.push(i);
        let seg = &mut self.segments[b.segment as usize];
        seg.live = false;
        seg.head = NONE;
        seg.tail = NONE;
        let size = seg.size;
        seg.size = 0;
        self.note_reserved(-(size as i64));
        self.stats.segments -= 1;
        self.stats.num_device_free += 1;
    }

    /// With `max_split_size` set: free cached oversize segments until `size` bytes could be had.
    fn release_available_cached_blocks(&mut self, size: u64, stream: u32) -> bool {
        let max_split = self.config.max_split_size;
        if max_split == u64::MAX {
            return false;
        }
        let wanted = size.max(max_split);
        let candidates: Vec<(u64, u32)> = self
            .large
            .range((stream, wanted, 0, 0)..(stream + 1, 0, 0, 0))
            .filter(|&&(_, _, _, i)| {
                !self.segments[self.blocks[i as usize].segment as usize].expandable
            })
            .map(|&(_, s, _, i)| (s, i))
            .collect();
        if let Some(&(_, i)) = candidates.first() {
            self.release_segment_of(i);
            return true;
        }
        let mut oversize: Vec<(u64, u32)> = self
            .large
            .range((stream, max_split, 0, 0)..(stream + 1, 0, 0, 0))
            .filter(|&&(_, _, _, i)| {
                !self.segments[self.blocks[i as usize].segment as usize].expandable
            })
            .map(|&(_, s, _, i)| (s, i))
            .collect();
        oversize.reverse();
        let mut freed = 0;
        for (s, i) in oversize {
            if freed >= wanted {
                break;
            }
            self.release_segment_of(i);
            freed += s;
        }
        freed >= wanted
    }

    /// `release_cached_blocks` / `empty_cache`: give back every whole free segment, and the free
    /// tail pages of expandable segments.
    pub fn release_cached_blocks(&mut self) {
        let whole: Vec<u32> = self
            .small
            .iter()
            .chain(self.large.iter())
            .map(|&(_, _, _, i)| i)
            .filter(|&i| {
                let b = &self.blocks[i as usize];
                b.prev == NONE && b.next == NONE && !self.segments[b.segment as usize].expandable
            })
            .collect();
        for i in whole {
            self.release_segment_of(i);
        }
        for seg in 0..self.segments.len() {
            let s = &self.segments[seg];
            if !(s.live && s.expandable) || s.tail == NONE || self.blocks[s.tail as usize].allocated
            {
                continue;
            }
            let page = if s.pool == Pool::Small {
                SMALL_BUFFER
            } else {
                LARGE_BUFFER
            };
            let (base, end, tail) = (s.base, s.base + s.size, s.tail);
            let start = self.blocks[tail as usize].addr;
            let keep_end = base + (start - base).div_ceil(page) * page;
            let unmap = end - keep_end;
            if unmap == 0 {
                continue;
            }
            self.remove_free(tail);
            self.note_reserved(-(unmap as i64));
            self.stats.num_device_free += 1;
            self.segments[seg].size -= unmap;
            let remaining = self.blocks[tail as usize].size - unmap;
            if remaining > 0 {
                self.blocks[tail as usize].size = remaining;
                self.insert_free(tail);
            } else {
                let prev = self.blocks[tail as usize].prev;
                self.spare_blocks.push(tail);
                let s = &mut self.segments[seg];
                s.tail = prev;
                if prev == NONE {
                    s.head = NONE;
                    s.live = false;
                    self.stats.segments -= 1;
                } else {
                    self.blocks[prev as usize].next = NONE;
                }
            }
        }
    }

    /// The layout of every live segment: (segment size, [(block size, allocated)]), for tests
    /// and snapshots.
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        self.segments
            .iter()
            .filter(|s| s.live)
            .map(|s| {
                let mut blocks = Vec::new();
                let mut i = s.head;
                while i != NONE {
                    let b = &self.blocks[i as usize];
                    blocks.push((b.size, b.allocated));
                    i = b.next;
                }
                SegmentSnapshot {
                    size: s.size,
                    pool: s.pool,
                    stream: s.stream,
                    blocks,
                }
            })
            .collect()
    }

    /// Free bytes in blocks of split segments (`inactive_split_bytes`): a fragmentation measure.
    pub fn inactive_split_bytes(&self) -> u64 {
        self.small
            .iter()
            .chain(self.large.iter())
            .map(|&(_, s, _, i)| (s, &self.blocks[i as usize]))
            .filter(|(_, b)| b.prev != NONE || b.next != NONE)
            .map(|(s, _)| s)
            .sum()
    }
}

/// One segment in [`CachingAllocator::snapshot`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SegmentSnapshot {
    pub size: u64,
    pub pool: Pool,
    pub stream: u32,
    /// Blocks in address order: (size, allocated).
    pub blocks: Vec<(u64, bool)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> CachingAllocator {
        CachingAllocator::new(AllocatorConfig::default(), 40 << 30)
    }

    #[test]
    fn spec_example_1_small_requests_share_one_segment() {
        let mut a = fresh();
        for r in [40_000, 40, 4_000, 40] {
            a.malloc(r, 0).unwrap();
        }
        let snap = a.snapshot();
        assert_eq!(snap.len(), 1);
        assert_eq!(snap[0].size, 2_097_152);
        assert_eq!(
            snap[0].blocks,
            vec![
                (40_448, true),
                (512, true),
                (4_096, true),
                (512, true),
                (2_051_584, false)
            ]
        );
        assert_eq!(a.stats().allocated, 45_568);
    }

    #[test]
    fn spec_example_2_cublas_workspace_splits_a_20_mib_segment() {
        let mut a = fresh();
        a.malloc(8_519_680, 0).unwrap();
        assert_eq!(a.stats().allocated, 8_519_680);
        assert_eq!(a.stats().reserved, 20_971_520);
        assert_eq!(
            a.snapshot()[0].blocks,
            vec![(8_519_680, true), (12_451_840, false)]
        );
    }

    #[test]
    fn spec_examples_3_and_4_no_split_then_best_fit_split() {
        let mut a = fresh();
        let b = a.malloc(26_214_400, 0).unwrap();
        assert_eq!(a.stats().reserved, 27_262_976);
        assert_eq!(
            a.stats().allocated,
            27_262_976,
            "remaining 1 MiB is not > 1 MiB: whole block handed out"
        );
        a.free(b);
        a.malloc(12 << 20, 0).unwrap();
        assert_eq!(a.stats().reserved, 27_262_976, "served from the cache");
        assert_eq!(
            a.snapshot()[0].blocks,
            vec![(12 << 20, true), (14_680_064, false)]
        );
    }

    #[test]
    fn spec_example_5_max_split_size() {
        let mut a = CachingAllocator::new(
            AllocatorConfig::parse("max_split_size_mb:128").unwrap(),
            40 << 30,
        );
        let big = a.malloc(200 << 20, 0).unwrap();
        a.free(big);
        a.malloc(100 << 20, 0).unwrap();
        assert_eq!(
            a.stats().reserved,
            300 << 20,
            "a normal request may not eat an oversize block"
        );
        let b = a.malloc(190 << 20, 0).unwrap();
        assert_eq!(
            a.block_size(b),
            200 << 20,
            "oversize request takes the cached block whole"
        );
        assert_eq!(a.stats().reserved, 300 << 20);
    }

    #[test]
    fn rounding_rules() {
        let c = AllocatorConfig::default();
        assert_eq!(c.round_size(1), 512);
        assert_eq!(c.round_size(513), 1024);
        let c = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        assert_eq!(c.round_size(1_200_000), 1_310_720, "spec §1.4.2 example");
        assert_eq!(c.round_size(1 << 21), 1 << 21);
        let c = AllocatorConfig::parse("roundup_power2_divisions:[1:4,256:8,>:16]").unwrap();
        assert_eq!(c.roundup_power2_divisions[0], 4);
        assert_eq!(c.roundup_power2_divisions[8], 8);
        assert_eq!(c.roundup_power2_divisions[15], 16);
        assert_eq!(c.roundup_power2_divisions[9], 16);
        assert_eq!(allocation_size(512), SMALL_BUFFER);
        assert_eq!(allocation_size(2 << 20), LARGE_BUFFER);
        assert_eq!(allocation_size(11 << 20), 12 << 20);
    }

    #[test]
    fn config_errors_are_one_line() {
        assert_eq!(
            AllocatorConfig::parse("max_split_size_mb:10")
                .unwrap_err()
                .to_string(),
            "option max_split_size_mb: 10 is below the minimum of 20"
        );
        assert_eq!(
            AllocatorConfig::parse("frobnicate:1")
                .unwrap_err()
                .to_string(),
            "unknown allocator option `frobnicate`"
        );
        assert_eq!(
            AllocatorConfig::parse("roundup_power2_divisions:3")
                .unwrap_err()
                .to_string(),
            "option roundup_power2_divisions: 3 is not a power of two"
        );
        assert_eq!(
            AllocatorConfig::parse("roundup_power2_divisions:[256:4,x:8]")
                .unwrap_err()
                .to_string(),
            "option roundup_power2_divisions: `x` is not a number"
        );
        assert_eq!(
            AllocatorConfig::parse("max_split_size_mb")
                .unwrap_err()
                .to_string(),
            "option `max_split_size_mb` has no value"
        );
        let c = AllocatorConfig::parse("expandable_segments:True,max_split_size_mb:64").unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, 64 << 20);
    }

    #[test]
    fn coalescing_restores_a_whole_segment() {
        let mut a = fresh();
        let x = a.malloc(3 << 20, 0).unwrap();
        let y = a.malloc(4 << 20, 0).unwrap();
        a.free(x);
        a.free(y);
        assert_eq!(a.snapshot()[0].blocks, vec![(LARGE_BUFFER, false)]);
        assert_eq!(a.inactive_split_bytes(), 0);
    }

    #[test]
    fn streams_do_not_share_cached_blocks() {
        let mut a = fresh();
        let x = a.malloc(4096, 0).unwrap();
        a.free(x);
        a.malloc(4096, 1).unwrap();
        assert_eq!(a.stats().reserved, 2 * SMALL_BUFFER);
    }

    #[test]
    fn oom_path_frees_cached_segments_then_retries() {
        let mut a = CachingAllocator::new(AllocatorConfig::default(), 100 << 20);
        let x = a.malloc(60 << 20, 0).unwrap();
        a.free(x);
        let y = a.malloc(80 << 20, 0).unwrap();
        assert_eq!(a.stats().reserved, 80 << 20);
        assert_eq!(a.stats().num_alloc_retries, 1);
        let err = a.malloc(40 << 20, 0).unwrap_err();
        assert_eq!(err.reserved, 80 << 20);
        assert_eq!(a.stats().num_ooms, 1);
        a.free(y);
    }

    #[test]
    fn expandable_segments_map_pages_on_demand() {
        let mut a = CachingAllocator::new(
            AllocatorConfig::parse("expandable_segments:True").unwrap(),
            40 << 30,
        );
        let x = a.malloc(30 << 20, 0).unwrap();
        assert_eq!(a.stats().reserved, 40 << 20, "two 20 MiB pages");
        let y = a.malloc(15 << 20, 0).unwrap();
        assert_eq!(
            a.stats().reserved,
            60 << 20,
            "the free 10 MiB tail grows by one page"
        );
        assert_eq!(a.stats().segments, 1);
        a.free(y);
        a.free(x);
        a.release_cached_blocks();
        assert_eq!(a.stats().reserved, 0);
    }
}
