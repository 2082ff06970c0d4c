//! Arithmetic that vectorizes and gives the same bits on every CPU: an `exp` built from fused
//! multiply-adds, eight-lane vectors ([`Lanes`]: AVX2 registers or plain arrays), and
//! [`fast_path!`], which compiles a loop twice (for AVX2 with FMA, and portable) and runs the
//! first where the CPU has it.
//!
//! A fused multiply-add is exactly rounded whether it is one FMA instruction or a library call
//! (`f32::mul_add`), so both builds give the same results; only the speed differs. (Plain
//! `exp` from the C library is neither vectorized nor required to round alike everywhere.)

/// `e^x`, within 2 units in the last place for `x` in the range where the result is a normal
/// number; 0 below it (also for `-inf`), `e^88` above it, NaN for NaN. Branch-free, so loops
/// over slices vectorize.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOW: f32 = -87.336_55; // ln(f32::MIN_POSITIVE)
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, so that x - n ln 2 is exact for the n that occur (Cody-Waite).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(LOW, 88.0);
    // Round to the nearest integer: adding 1.5 * 2^23 leaves no fraction bits, and the low bits
    // of the sum are then n's (plus 0x4B40_0000), which builds 2^n below without a float to
    // integer conversion (Rust's saturating `as i32` does not vectorize: a loop over `exp`
    // was 1.8 ns per value with it).
    let shifted = xc * LOG2E + 12_582_912.0;
    let n = shifted - 12_582_912.0;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    // e^r on [-ln2/2, ln2/2]: the minimax polynomial of Cephes' expf.
    let mut p = 1.987_569_2e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5); // 5.0000001201e-1 rounds to 0.5 in f32
    let er = p.mul_add(r * r, r) + 1.0;
    // n is in -126..=127 (xc is clamped; NaN aside, whose product stays NaN), so n + 127 is a
    // normal number's exponent.
    let e = er * f32::from_bits(shifted.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    if x < LOW {
        0.0
    } else {
        e
    }
}

/// Whether this CPU runs the AVX2 + FMA build of [`fast_path!`] functions.
#[inline]
pub fn has_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Eight `f32` lanes, with the same lane-wise arithmetic in every implementation.
///
/// # Safety
/// The methods of an implementation may use CPU features (AVX2 and FMA for `__m256`): call
/// them only where the CPU has them.
pub trait Lanes: Copy {
    /// All lanes zero.
    unsafe fn zero() -> Self;
    /// The first eight values of `x`.
    unsafe fn load(x: &[f32]) -> Self;
    /// Writes the lanes to the first eight values of `x`.
    unsafe fn store(self, x: &mut [f32]);
    /// `v` in every lane.
    unsafe fn splat(v: f32) -> Self;
    /// `a * b + c` per lane, rounded once.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    /// `a + b` per lane.
    unsafe fn add(a: Self, b: Self) -> Self;
    /// The lanes in order.
    unsafe fn lanes(self) -> [f32; 8];
    /// The sum of each vector's lanes in the tree `((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7))`.
    #[inline(always)]
    unsafe fn sums4(v: [Self; 4]) -> [f32; 4] {
        v.map(|v| {
            let s = v.lanes();
            ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]))
        })
    }
}

impl Lanes for [f32; 8] {
    #[inline(always)]
    unsafe fn zero() -> Self {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn load(x: &[f32]) -> Self {
        x[..8].try_into().unwrap()
    }
    #[inline(always)]
    unsafe fn store(self, x: &mut [f32]) {
        x[..8].copy_from_slice(&self)
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        [v; 8]
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        std::array::from_fn(|l| a[l].mul_add(b[l], c[l]))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        std::array::from_fn(|l| a[l] + b[l])
    }
    #[inline(always)]
    unsafe fn lanes(self) -> [f32; 8] {
        self
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    // SAFETY (every method): the trait's contract: the CPU has AVX2 and FMA. Slices are
    // checked before the unaligned loads and stores.
    impl super::Lanes for __m256 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load(x: &[f32]) -> Self {
            _mm256_loadu_ps(x[..8].as_ptr())
        }
        #[inline(always)]
        unsafe fn store(self, x: &mut [f32]) {
            _mm256_storeu_ps(x[..8].as_mut_ptr(), self)
        }
        #[inline(always)]
        unsafe fn splat(v: f32) -> Self {
            _mm256_set1_ps(v)
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn lanes(self) -> [f32; 8] {
            std::mem::transmute(self)
        }
        /// The same tree as the lanes one by one, for four vectors at once: the halves'
        /// sums (lanes l + (l + 4)), then `hadd`'s neighbouring pairs twice.
        #[inline(always)]
        unsafe fn sums4(v: [Self; 4]) -> [f32; 4] {
            let h = v.map(|v| _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v)));
            let s = _mm_hadd_ps(_mm_hadd_ps(h[0], h[1]), _mm_hadd_ps(h[2], h[3]));
            std::mem::transmute(s)
        }
    }
}

/// Defines a function whose body is compiled twice: for AVX2 with FMA, run where the CPU has
/// them, and portable. The body must give the same results either way (floating-point work
/// through `mul_add` and [`exp`], no CPU-dependent intrinsics).
macro_rules! fast_path {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$doc])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                /// # Safety
                /// The CPU must have AVX2 and FMA.
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fast($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if $crate::vecmath::has_fma() {
                    // SAFETY: the CPU has the features `fast` is compiled for.
                    return unsafe { fast($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use fast_path;

fast_path! {
    /// `out[i] = e^((xs[i] - shift) * scale)`, as [`exp`].
    pub fn exp_shifted(xs: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
        for (o, &x) in out.iter_mut().zip(xs) {
            *o = exp((x - shift) * scale);
        }
    }
}

fast_path! {
    /// The sum of `xs` in a fixed order ([`tree_sum`]).
    pub fn sum(xs: &[f32]) -> f32 {
        tree_sum(xs)
    }
}

fast_path! {
    /// The sum of `xs` in f64, in [`sum`]'s order: for totals that must be exact to far below
    /// f32's rounding, where one large value would swallow a long tail of small ones in f32.
    pub fn sum_f64(xs: &[f32]) -> f64 {
        tree_sum(xs)
    }
}

/// The sum of `xs` in `A`: eight running sums over the whole chunks, added in a fixed tree,
/// then the rest in order.
#[inline(always)]
fn tree_sum<A: Copy + Default + std::ops::Add<Output = A> + From<f32>>(xs: &[f32]) -> A {
    let mut acc = [A::default(); 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] = acc[l] + A::from(c[l]);
        }
    }
    let total = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    rest.iter().fold(total, |t, &x| t + A::from(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AVX2's four-at-once lane sums take the portable tree: the same bits, on values of
    /// mixed signs and magnitudes where another order would round differently.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx2_lane_sums_take_the_portable_tree() {
        use std::arch::x86_64::__m256;
        if !has_fma() {
            return;
        }
        let mut state = 1u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let x = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            x * [1.0, 1e4, 1e-4, 3e7][(state >> 20) as usize % 4]
        };
        for _ in 0..1000 {
            let v: [[f32; 8]; 4] = std::array::from_fn(|_| std::array::from_fn(|_| next()));
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            let fast = unsafe { <__m256 as Lanes>::sums4(v.map(|v| std::mem::transmute(v))) };
            // SAFETY: arrays need no CPU feature.
            let portable = unsafe { <[f32; 8] as Lanes>::sums4(v) };
            assert_eq!(fast.map(f32::to_bits), portable.map(f32::to_bits), "{v:?}");
        }
    }

    #[test]
    fn exp_is_within_two_ulps_of_the_exact_value() {
        let mut worst = 0f64;
        let mut x = -87.3f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            let ulp = (want as f32).to_bits().abs_diff((got as f32).to_bits());
            assert!(ulp <= 2, "exp({x}) = {got}, want {want}");
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_3;
        }
        assert!(worst < 2.5e-7, "{worst}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(1000.0).is_finite());
    }

    /// 2^n built from the rounding sum's bits is what the plain conversion `n as i32` gives:
    /// the same bits at the ends of the range (where n is -126 and 127), at the clamps and
    /// their neighbours, for the special values, and on a spread of every bit pattern.
    #[test]
    fn exp_builds_the_exponent_as_the_conversion_does() {
        fn by_conversion(x: f32) -> f32 {
            let xc = x.clamp(-87.336_55, 88.0);
            let n = (xc * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
            let r = n.mul_add(2.121_944_4e-4, n.mul_add(-0.693_359_4, xc));
            let mut p = 1.987_569_2e-4f32;
            for c in [
                1.398_199_9e-3,
                8.333_452e-3,
                4.166_579_6e-2,
                1.666_666_5e-1,
                0.5,
            ] {
                p = p.mul_add(r, c);
            }
            let e = (p.mul_add(r * r, r) + 1.0) * f32::from_bits(((n as i32 + 127) as u32) << 23);
            if x < -87.336_55 {
                0.0
            } else {
                e
            }
        }
        let edges = [-87.336_55f32, 88.0, -87.3, 87.9, 0.0, -0.0, 1e-30, -1e-30];
        let specials = [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
            f32::NAN,
        ];
        let near = edges.iter().flat_map(|&x| {
            (-3..=3i32).map(move |d| f32::from_bits(x.to_bits().wrapping_add_signed(d)))
        });
        let spread = (0..=u32::MAX).step_by(9_973).map(f32::from_bits);
        for x in near.chain(specials).chain(spread) {
            let (got, want) = (exp(x), by_conversion(x));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "exp({x}) = {got}, by conversion {want}"
            );
        }
    }

    #[test]
    fn exp_shifted_and_sum_match_their_definitions() {
        let xs: Vec<f32> = (0..4099).map(|i| (i as f32 - 2048.0) * 0.043).collect();
        let mut got = vec![0f32; xs.len()];
        exp_shifted(&xs, 3.0, 0.5, &mut got);
        assert!(got
            .iter()
            .zip(&xs)
            .all(|(g, &x)| g.to_bits() == exp((x - 3.0) * 0.5).to_bits()));
        let want = xs.iter().map(|&x| x as f64).sum::<f64>();
        assert!((sum(&xs) as f64 - want).abs() < 1e-3 * want.abs().max(1.0));
        assert_eq!(sum(&[1.0, 2.0, 3.0]), 6.0);
        assert_eq!(sum(&[]), 0.0);
    }
}
