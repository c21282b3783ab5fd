// ropekit: rotary position embedding (RoPE) compute kernels in WGSL.
//
// Data: binding 0 holds a row-major [seq_len, n_heads, head_dim] tensor, rotated in place. Token s sits at
// position s + pos_offset. Forward rotates pair (lo, hi) by +theta, theta = position * freq[p]:
//     lo' = lo * cos(theta) - hi * sin(theta)
//     hi' = lo * sin(theta) + hi * cos(theta)
// and the *_backward entry points rotate by -theta (the transpose: the gradient of the forward rotation).
//
// Bindings (group 0):
//   0  storage, read_write  array<f32> [seq_len * n_heads * head_dim]; the *_f16 entry points read the same
//                           binding as array<u32>, two f16 values per word (element 2w in the low half of word w)
//   1  uniform              dims:   vec4<u32>(seq_len, n_heads, head_dim, pos_offset)
//   2  uniform              params: vec4<f32>(rope_base, unused, unused, unused)      (base kernels only)
//   3  storage, read        inv_freq: array<f32> [head_dim / 2]                        (*_freq kernels only)
//   4  storage, read        cos_sin: array<vec2<f32>> [rows, head_dim / 2], (cos, sin) of the angle of table row
//                           s + pos_offset                                             (*_table kernels only)
// An entry point uses only the bindings it names; with layout "auto" its bind group holds exactly those.
//
// Entry points: "rope" [_neox] [_freq | _table] [_f16] [_backward]. The interleaved f32 kernels that take their
// frequencies from rope_base are named rope_q / rope_k (and rope_q_backward / rope_k_backward); they are the
// same code, rope_k being run with n_kv_heads in dims.y.
//   pairing   interleaved: (2i, 2i + 1)            _neox: (i, i + head_dim / 2)
//   freq      base: rope_base^(-2p / head_dim), computed here in f32
//             _freq: inv_freq[p] from binding 3 (e.g. transformers' float32 inv_freq)
//             _table: no angle here; cos/sin rows from binding 4
//   dtype     f32, or _f16: packed halves, f32 arithmetic, one rounding to f16 at the store (no shader-f16
//             feature needed)
//
// Dispatch: @workgroup_size(256); one invocation per (s, h, pair) -- per (s, h, two pairs) for _neox_f16 --
// so seq_len * n_heads * head_dim / 2 invocations (/ 4 for _neox_f16). Workgroups may be laid out on a 2-D grid
// (x, y) when there are more than the 65535 a dimension allows: invocation i = gid.x + gid.y * num_workgroups.x
// * 256; invocations past the end return.
//
// Angles: position * freq is formed exactly in 32-bit integer arithmetic as a 64-bit fraction of a turn (the
// frequency times 96 bits of 1/(2 pi)), reduced to the nearest quarter turn, and sin/cos of the remaining
// |x| <= pi/4 come from short polynomials. The error stays near 1e-7 for every position below 2^32 and does not
// depend on the adapter's sin/cos accuracy (which WGSL only bounds by 2^-11).
//
// Checks: head_dim must be even (a multiple of 4 for _neox_f16), |freq| finite and below 2^24, and a table row
// must exist; otherwise the pairs concerned are written as NaN instead of being left silently unrotated.

const WORKGROUP_SIZE: u32 = 256u;
const FORWARD: f32 = 1.0;
const BACKWARD: f32 = -1.0;
const NAN_F32_BITS: u32 = 0x7fc00000u;
const NAN_F16_PAIR_BITS: u32 = 0x7e007e00u;

// floor(2^96 / (2 pi)), most significant word first.
const INV_TWO_PI_2: u32 = 0x28be60dbu;
const INV_TWO_PI_1: u32 = 0x9391054au;
const INV_TWO_PI_0: u32 = 0x7f09d5f4u;
const TWO_PI_OVER_2_POW_32: f32 = 1.4629180792671596e-9;
const INV_2_POW_32: f32 = 2.3283064365386963e-10;

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(0) var<storage, read_write> x_f16: array<u32>;
@group(0) @binding(1) var<uniform> dims: vec4<u32>;
@group(0) @binding(2) var<uniform> params: vec4<f32>;
@group(0) @binding(3) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(4) var<storage, read> cos_sin: array<vec2<f32>>;

// ---------------------------------------------------------------------------------------------------------------
// Work decomposition

struct Unit {
    in_range: bool,     // false for the padding invocations of the last workgroup(s)
    well_formed: bool,  // head_dim fits the kernel's pairing
    s: u32,             // token
    h: u32,             // head
    j: u32,             // pair (or pair of pairs for _neox_f16) within the head
}

// units_per_head: head_dim / 2, or head_dim / 4 for _neox_f16; divisor: head_dim must be a multiple of it.
fn unit_of(gid: vec3<u32>, nwg: vec3<u32>, units_per_head: u32, divisor: u32) -> Unit {
    let i = gid.x + gid.y * (nwg.x * WORKGROUP_SIZE);
    let units_per_token = dims.y * units_per_head;
    var u: Unit;
    u.in_range = units_per_token > 0u && i < dims.x * units_per_token;
    u.well_formed = dims.z % divisor == 0u;
    u.s = i / units_per_token;
    let rest = i % units_per_token;
    u.h = rest / units_per_head;
    u.j = rest % units_per_head;
    return u;
}

// ---------------------------------------------------------------------------------------------------------------
// Exact angle reduction: position * freq as a 64-bit fraction of a turn, in u32 arithmetic only

// Low and high words of the 64-bit product a * b.
fn mul_wide(a: u32, b: u32) -> vec2<u32> {
    let a_lo = a & 0xffffu;
    let a_hi = a >> 16u;
    let b_lo = b & 0xffffu;
    let b_hi = b >> 16u;
    let ll = a_lo * b_lo;
    let lh = a_lo * b_hi;
    let hl = a_hi * b_lo;
    let mid = (ll >> 16u) + (lh & 0xffffu) + (hl & 0xffffu);
    return vec2<u32>((ll & 0xffffu) | (mid << 16u), a_hi * b_hi + (lh >> 16u) + (hl >> 16u) + (mid >> 16u));
}

// floor(2^96 / (2 pi) / 2^n) as three words, least significant first.
fn inv_two_pi_shifted(n: u32) -> vec3<u32> {
    var w = vec3<u32>(INV_TWO_PI_0, INV_TWO_PI_1, INV_TWO_PI_2);
    if (n >= 96u) {
        return vec3<u32>(0u);
    }
    let words = n / 32u;
    if (words == 1u) {
        w = vec3<u32>(w.y, w.z, 0u);
    } else if (words == 2u) {
        w = vec3<u32>(w.z, 0u, 0u);
    }
    let bits = n % 32u;
    if (bits == 0u) {  // a shift by 32 would be taken modulo 32 in WGSL
        return w;
    }
    let up = 32u - bits;
    return vec3<u32>((w.x >> bits) | (w.y << up), (w.y >> bits) | (w.z << up), w.z >> bits);
}

// |freq| / (2 pi) in units of 2^-64 turn, modulo 2^64 (whole turns never matter): the 24-bit significand of
// freq times the matching 96-bit window of 1/(2 pi). Requires a biased exponent <= 150 (|freq| < 2^24).
fn turns_per_position(freq_bits: u32) -> vec2<u32> {
    let biased_exponent = (freq_bits >> 23u) & 0xffu;
    if (biased_exponent == 0u) {  // zero or subnormal: the angle is below 2^-94 turn for any u32 position
        return vec2<u32>(0u);
    }
    let significand = (freq_bits & 0x7fffffu) | 0x800000u;
    // freq = significand * 2^(biased_exponent - 150); keep 32 fraction bits of the product, then drop them.
    let w = inv_two_pi_shifted(150u - biased_exponent);
    let p0 = mul_wide(significand, w.x);
    let p1 = mul_wide(significand, w.y);
    let low = p0.y + p1.x;
    let carry = select(0u, 1u, low < p0.y);
    return vec2<u32>(low, p1.y + significand * w.z + carry);
}

struct Rotation {
    c: f32,
    s: f32,
    valid: bool,
}

// cos and sin of a 64-bit fraction of a turn (low word, high word).
fn cos_sin_of_turns(turns: vec2<u32>) -> vec2<f32> {
    // Nearest quarter turn in the top two bits; the rest, signed, is an angle of at most an eighth of a turn.
    let shifted = turns.y + 0x20000000u;
    let quadrant = shifted >> 30u;
    let rest = f32(i32(shifted & 0x3fffffffu) - 0x20000000) + f32(turns.x) * INV_2_POW_32;
    let a = rest * TWO_PI_OVER_2_POW_32;  // radians, |a| <= pi / 4
    let a2 = a * a;
    // Taylor series to a^9 and a^10: truncation below 2e-9 on |a| <= pi / 4.
    let sin_a = a + a * a2 * (-1.0 / 6.0 + a2 * (1.0 / 120.0 + a2 * (-1.0 / 5040.0 + a2 * (1.0 / 362880.0))));
    let cos_a = 1.0 + a2 * (-0.5 + a2 * (1.0 / 24.0 + a2 * (-1.0 / 720.0 + a2 * (1.0 / 40320.0
        + a2 * (-1.0 / 3628800.0)))));
    var cs = vec2<f32>(cos_a, sin_a);
    if ((quadrant & 1u) == 1u) {  // + a quarter turn: (cos, sin) -> (-sin, cos)
        cs = vec2<f32>(-sin_a, cos_a);
    }
    if (quadrant >= 2u) {  // + a half turn
        cs = -cs;
    }
    return cs;
}

// Rotation by direction * position * freq.
fn angle_rotation(position: u32, freq: f32, direction: f32) -> Rotation {
    let bits = bitcast<u32>(freq);
    if (((bits >> 23u) & 0xffu) > 150u) {  // |freq| >= 2^24, infinite or NaN
        return Rotation(0.0, 0.0, false);
    }
    let g = turns_per_position(bits);
    let p = mul_wide(position, g.x);
    var turns = vec2<u32>(p.x, p.y + position * g.y);
    if ((bits >> 31u) == 1u) {  // negative frequency: negate the fraction of a turn (two's complement)
        let low = ~turns.x + 1u;
        turns = vec2<u32>(low, ~turns.y + select(0u, 1u, low == 0u));
    }
    let cs = cos_sin_of_turns(turns);
    return Rotation(cs.x, direction * cs.y, true);
}

// ---------------------------------------------------------------------------------------------------------------
// Where the rotation of pair p of token s comes from

fn base_rotation(s: u32, p: u32, direction: f32) -> Rotation {
    let exponent = f32(2u * p) / f32(dims.z);
    return angle_rotation(s + dims.w, exp2(-exponent * log2(params.x)), direction);
}

fn freq_rotation(s: u32, p: u32, direction: f32) -> Rotation {
    if (p >= arrayLength(&inv_freq)) {
        return Rotation(0.0, 0.0, false);
    }
    return angle_rotation(s + dims.w, inv_freq[p], direction);
}

fn table_rotation(s: u32, p: u32, direction: f32) -> Rotation {
    let half = dims.z / 2u;
    let row = s + dims.w;
    if (half == 0u || row >= arrayLength(&cos_sin) / half) {
        return Rotation(0.0, 0.0, false);
    }
    let cs = cos_sin[row * half + p];
    return Rotation(cs.x, direction * cs.y, true);
}

// ---------------------------------------------------------------------------------------------------------------
// In-place stores: both values of a pair are read before either is written.

// NaN from a runtime value: WGSL rejects a constant expression that evaluates to NaN.
fn nan_f32() -> f32 {
    return bitcast<f32>(NAN_F32_BITS | (dims.x & 0u));
}

fn rotate_f32(i_lo: u32, i_hi: u32, ok: bool, r: Rotation) {
    if (!(ok && r.valid)) {
        x[i_lo] = nan_f32();
        x[i_hi] = nan_f32();
        return;
    }
    let lo = x[i_lo];
    let hi = x[i_hi];
    x[i_lo] = lo * r.c - hi * r.s;
    x[i_hi] = lo * r.s + hi * r.c;
}

fn rotate_interleaved_f32(u: Unit, r: Rotation) {
    let i_lo = (u.s * dims.y + u.h) * dims.z + 2u * u.j;
    rotate_f32(i_lo, i_lo + 1u, u.well_formed, r);
}

fn rotate_neox_f32(u: Unit, r: Rotation) {
    let i_lo = (u.s * dims.y + u.h) * dims.z + u.j;
    rotate_f32(i_lo, i_lo + dims.z / 2u, u.well_formed, r);
}

// One word = one interleaved pair (lo in the low half).
fn rotate_interleaved_f16(u: Unit, r: Rotation) {
    let w = (u.s * dims.y + u.h) * (dims.z / 2u) + u.j;
    if (!(u.well_formed && r.valid)) {
        x_f16[w] = NAN_F16_PAIR_BITS;
        return;
    }
    let v = unpack2x16float(x_f16[w]);
    x_f16[w] = pack2x16float(vec2<f32>(v.x * r.c - v.y * r.s, v.x * r.s + v.y * r.c));
}

// Word j of the first half holds the lo values of pairs 2j and 2j + 1; word j of the second half their hi values.
// Owning both words keeps each 32-bit word written by one invocation.
fn rotate_neox_f16(u: Unit, r0: Rotation, r1: Rotation) {
    let w_lo = (u.s * dims.y + u.h) * (dims.z / 2u) + u.j;
    let w_hi = w_lo + dims.z / 4u;
    if (!(u.well_formed && r0.valid && r1.valid)) {
        x_f16[w_lo] = NAN_F16_PAIR_BITS;
        x_f16[w_hi] = NAN_F16_PAIR_BITS;
        return;
    }
    let lo = unpack2x16float(x_f16[w_lo]);
    let hi = unpack2x16float(x_f16[w_hi]);
    let c = vec2<f32>(r0.c, r1.c);
    let s = vec2<f32>(r0.s, r1.s);
    x_f16[w_lo] = pack2x16float(lo * c - hi * s);
    x_f16[w_hi] = pack2x16float(lo * s + hi * c);
}

// ---------------------------------------------------------------------------------------------------------------
// Entry points, f32. Interleaved with frequencies from rope_base: rope_q / rope_k.

@compute @workgroup_size(256)
fn rope_q(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f32(u, base_rotation(u.s, u.j, FORWARD)); }
}

@compute @workgroup_size(256)
fn rope_k(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f32(u, base_rotation(u.s, u.j, FORWARD)); }
}

@compute @workgroup_size(256)
fn rope_q_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f32(u, base_rotation(u.s, u.j, BACKWARD)); }
}

@compute @workgroup_size(256)
fn rope_k_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f32(u, base_rotation(u.s, u.j, BACKWARD)); }
}

@compute @workgroup_size(256)
fn rope_neox(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_neox_f32(u, base_rotation(u.s, u.j, FORWARD)); }
}

@compute @workgroup_size(256)
fn rope_neox_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_neox_f32(u, base_rotation(u.s, u.j, BACKWARD)); }
}

@compute @workgroup_size(256)
fn rope_freq(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f32(u, freq_rotation(u.s, u.j, FORWARD)); }
}

@compute @workgroup_size(256)
fn rope_freq_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f32(u, freq_rotation(u.s, u.j, BACKWARD)); }
}

@compute @workgroup_size(256)
fn rope_neox_freq(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_neox_f32(u, freq_rotation(u.s, u.j, FORWARD)); }
}

@compute @workgroup_size(256)
fn rope_neox_freq_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_neox_f32(u, freq_rotation(u.s, u.j, BACKWARD)); }
}

@compute @workgroup_size(256)
fn rope_table(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f32(u, table_rotation(u.s, u.j, FORWARD)); }
}

@compute @workgroup_size(256)
fn rope_table_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f32(u, table_rotation(u.s, u.j, BACKWARD)); }
}

@compute @workgroup_size(256)
fn rope_neox_table(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_neox_f32(u, table_rotation(u.s, u.j, FORWARD)); }
}

@compute @workgroup_size(256)
fn rope_neox_table_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_neox_f32(u, table_rotation(u.s, u.j, BACKWARD)); }
}

// ---------------------------------------------------------------------------------------------------------------
// Entry points, packed f16.

@compute @workgroup_size(256)
fn rope_f16(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f16(u, base_rotation(u.s, u.j, FORWARD)); }
}

@compute @workgroup_size(256)
fn rope_f16_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f16(u, base_rotation(u.s, u.j, BACKWARD)); }
}

@compute @workgroup_size(256)
fn rope_neox_f16(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 4u, 4u);
    if (u.in_range) {
        rotate_neox_f16(u, base_rotation(u.s, 2u * u.j, FORWARD), base_rotation(u.s, 2u * u.j + 1u, FORWARD));
    }
}

@compute @workgroup_size(256)
fn rope_neox_f16_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 4u, 4u);
    if (u.in_range) {
        rotate_neox_f16(u, base_rotation(u.s, 2u * u.j, BACKWARD), base_rotation(u.s, 2u * u.j + 1u, BACKWARD));
    }
}

@compute @workgroup_size(256)
fn rope_freq_f16(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f16(u, freq_rotation(u.s, u.j, FORWARD)); }
}

@compute @workgroup_size(256)
fn rope_freq_f16_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f16(u, freq_rotation(u.s, u.j, BACKWARD)); }
}

@compute @workgroup_size(256)
fn rope_neox_freq_f16(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 4u, 4u);
    if (u.in_range) {
        rotate_neox_f16(u, freq_rotation(u.s, 2u * u.j, FORWARD), freq_rotation(u.s, 2u * u.j + 1u, FORWARD));
    }
}

@compute @workgroup_size(256)
fn rope_neox_freq_f16_backward(@builtin(global_invocation_id) gid: vec3<u32>,
                               @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 4u, 4u);
    if (u.in_range) {
        rotate_neox_f16(u, freq_rotation(u.s, 2u * u.j, BACKWARD), freq_rotation(u.s, 2u * u.j + 1u, BACKWARD));
    }
}

@compute @workgroup_size(256)
fn rope_table_f16(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f16(u, table_rotation(u.s, u.j, FORWARD)); }
}

@compute @workgroup_size(256)
fn rope_table_f16_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 2u, 2u);
    if (u.in_range) { rotate_interleaved_f16(u, table_rotation(u.s, u.j, BACKWARD)); }
}

@compute @workgroup_size(256)
fn rope_neox_table_f16(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 4u, 4u);
    if (u.in_range) {
        rotate_neox_f16(u, table_rotation(u.s, 2u * u.j, FORWARD), table_rotation(u.s, 2u * u.j + 1u, FORWARD));
    }
}

@compute @workgroup_size(256)
fn rope_neox_table_f16_backward(@builtin(global_invocation_id) gid: vec3<u32>,
                                @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = unit_of(gid, nwg, dims.z / 4u, 4u);
    if (u.in_range) {
        rotate_neox_f16(u, table_rotation(u.s, 2u * u.j, BACKWARD), table_rotation(u.s, 2u * u.j + 1u, BACKWARD));
    }
}
