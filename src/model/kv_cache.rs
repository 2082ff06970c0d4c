//! Per-layer key/value cache: rows appended as tokens are fed, rollback by shortening.

/// Positions whose rows a cache keeps allocated however short its sequence gets.
const KEEP_POSITIONS: usize = 4096;

/// Keys and values for every layer, laid out `[position][kv_head][head_dim]` so that feeding
/// tokens appends and rolling back after a rejected draft is a truncation, never a copy.
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    row: usize,
    len: usize,
}

impl KvCache {
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self {
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
            row: kv_heads * head_dim,
            len: 0,
        }
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Appends `k` and `v` (whole rows of `kv_heads * head_dim`) to `layer`, after its
    /// committed positions: rows an unfinished forward left uncommitted are dropped first.
    /// The new length takes effect with [`KvCache::commit`] once every layer has appended.
    ///
    /// Panics if `k` and `v` are not the same whole number of rows.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        assert!(
            k.len() == v.len() && k.len().is_multiple_of(self.row),
            "keys and values of {} and {} values, rows of {}",
            k.len(),
            v.len(),
            self.row
        );
        self.keys[layer].truncate(self.len * self.row);
        self.values[layer].truncate(self.len * self.row);
        self.keys[layer].extend_from_slice(k);
        self.values[layer].extend_from_slice(v);
    }

    /// Marks `n` appended positions as cached.
    pub fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// The keys and values of `layer` for the cached positions plus those appended since.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.keys[layer], &self.values[layer])
    }

    /// Keeps only the first `len` positions (all of them if `len >= self.len()`), and drops
    /// the rows appended since the last [`KvCache::commit`] (a forward pass that failed or
    /// panicked between the two).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        let kept = self.len * self.row;
        // After a long sequence, a short one returns the memory (a rollback never does).
        let spare = (2 * self.len).max(KEEP_POSITIONS) * self.row;
        for v in self.keys.iter_mut().chain(self.values.iter_mut()) {
            v.truncate(kept);
            if v.capacity() > 2 * spare {
                v.shrink_to(spare);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncating_drops_rows_appended_but_not_committed() {
        let mut cache = KvCache::new(2, 1, 2);
        // A forward pass that failed after layer 0 appended, at length 0 and at length 1.
        for committed in [0, 1] {
            cache.append(0, &[9.0; 2], &[9.0; 2]);
            cache.truncate(committed);
            assert_eq!(cache.len(), committed);
            assert_eq!(cache.layer(0).0.len(), committed * 2);
            cache.append(0, &[1.0; 2], &[1.0; 2]);
            cache.append(1, &[1.0; 2], &[1.0; 2]);
            cache.commit(1);
            assert_eq!(cache.layer(0).0, &[1.0; 2].repeat(committed + 1)[..]);
            assert_eq!(cache.layer(0).1.len(), cache.layer(1).1.len());
        }
    }

    /// A forward that stopped between `append` and `commit`, not truncated after: the next
    /// forward's rows still follow the committed ones.
    #[test]
    fn appending_drops_rows_left_uncommitted() {
        let mut cache = KvCache::new(1, 1, 2);
        cache.append(0, &[1.0; 2], &[1.0; 2]);
        cache.commit(1);
        cache.append(0, &[9.0; 4], &[9.0; 4]);
        cache.append(0, &[2.0; 2], &[2.0; 2]);
        cache.commit(1);
        assert_eq!(cache.layer(0).0, &[1.0, 1.0, 2.0, 2.0][..]);
        assert_eq!(cache.layer(0).1, &[1.0, 1.0, 2.0, 2.0][..]);
    }

    #[test]
    fn a_short_sequence_after_a_long_one_returns_the_memory() {
        let mut cache = KvCache::new(1, 1, 2);
        let long = 10 * KEEP_POSITIONS;
        cache.append(0, &vec![1.0; 2 * long], &vec![1.0; 2 * long]);
        cache.commit(long);
        // A rollback keeps the allocation; a new short sequence does not.
        cache.truncate(long - 5);
        assert!(cache.keys[0].capacity() >= 2 * long);
        cache.truncate(10);
        assert_eq!(cache.layer(0).0, &[1.0; 20][..]);
        assert!(cache.keys[0].capacity() <= 2 * KEEP_POSITIONS);
        assert!(cache.values[0].capacity() <= 2 * KEEP_POSITIONS);
    }
}
