#!/usr/bin/env bash
# Which x86 instruction-set extensions execute on this machine, found by compiling and running one tiny
# program per extension; prints the llama.cpp (ggml) CMake flags for exactly those, with GGML_NATIVE=OFF.
#
#   scripts/probe_isa.sh RESULTS_TSV
#
# Why not -march=native or /proc/cpuinfo: a virtual CPU can advertise extensions (AMX tile/int8,
# AVX512-FP16) that then raise SIGILL, and a GGML_NATIVE build of llama.cpp dies with "Illegal instruction".
# Each probe's outcome goes to RESULTS_TSV, one "extension<TAB>outcome" a line: "runs", "no (signal N)",
# "no (kernel refused tile state)" (AMX), "no (exit N)" or "no (compiler)"; stdout gets the CMake flags, one line.
set -euo pipefail

results="${1:?usage: probe_isa.sh RESULTS_TSV}"
cc="${CC:-cc}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
: >"$results"

# probe NAME "COMPILER FLAGS" BODY: BODY computes an int `r` from the volatile int `seed` (so nothing folds
# away at compile time); the program prints it and exits 0 only when the instruction ran.
probe() {
    local name="$1" flags="$2" body="$3" outcome rc
    cat >"$work/$name.c" <<EOF
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
volatile int seed = 3;
int main(void) {
    int r = 0;
    $body
    printf("%d\n", r);
    return 0;
}
EOF
    if ! "$cc" -O1 $flags "$work/$name.c" -o "$work/$name" 2>"$work/$name.log"; then
        outcome="no (compiler)"
    else
        # In a subshell whose stderr is discarded: bash reports a child's SIGILL ("Illegal instruction") itself.
        rc="$( { timeout 10 "$work/$name" >/dev/null 2>&1 && echo 0 || echo $?; } 2>/dev/null)"
        if ((rc == 0)); then
            outcome="runs"
        elif [[ "$name" == amx_* ]] && ((rc == 2)); then
            outcome="no (kernel refused tile state)"
        elif ((rc > 128)); then
            outcome="no (signal $((rc - 128)))"
        else
            outcome="no (exit $rc)"
        fi
    fi
    printf '%s\t%s\n' "$name" "$outcome" >>"$results"
}

# Linux hands out AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, 0x1023/18),
# as ggml's amx.cpp does before its first tile instruction; without it the first one faults even where AMX
# exists. The 64-byte tile configuration: palette 1, tiles 0-2 of 16 rows x 64 bytes.
amx_setup='
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2;
    unsigned char config[64]; memset(config, 0, sizeof config); config[0] = 1;
    for (int t = 0; t < 3; t++) { config[16 + 2 * t] = 64; config[48 + t] = 16; }
    _tile_loadconfig(config);
    static int a[256], b[256], c[256];
    for (int i = 0; i < 256; i++) { a[i] = seed; b[i] = seed + 1; }
    _tile_loadd(1, a, 64); _tile_loadd(2, b, 64); _tile_zero(0);'

probe sse42 "-msse4.2" 'r = (int)_mm_crc32_u32((unsigned)seed, 7u);'
probe avx "-mavx" '__m256 v = _mm256_set1_ps((float)seed); v = _mm256_add_ps(v, v); r = (int)_mm256_cvtss_f32(v);'
probe avx2 "-mavx2" '__m256i v = _mm256_set1_epi32(seed); v = _mm256_add_epi32(v, v); r = _mm256_extract_epi32(v, 3);'
probe fma "-mfma" '__m256 v = _mm256_set1_ps((float)seed); v = _mm256_fmadd_ps(v, v, v); r = (int)_mm256_cvtss_f32(v);'
probe f16c "-mf16c" '__m128i h = _mm_set1_epi16((short)(0x3c00 + seed)); __m256 v = _mm256_cvtph_ps(h); r = (int)_mm256_cvtss_f32(v);'
probe bmi2 "-mbmi2" 'r = (int)_pdep_u32((unsigned)seed, 0xf0f0u);'
probe avx_vnni "-mavxvnni" '__m256i v = _mm256_set1_epi32(seed); v = _mm256_dpbusd_avx_epi32(v, v, v); r = _mm256_extract_epi32(v, 0);'
# ggml's GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw: one of each.
probe avx512 "-mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw" '
    __m512i v = _mm512_add_epi32(_mm512_set1_epi32(seed), _mm512_set1_epi32(1));  /* F */
    v = _mm512_conflict_epi32(v);                                                  /* CD */
    v = _mm512_add_epi8(v, _mm512_set1_epi8((char)seed));                         /* BW */
    v = _mm512_xor_epi64(v, _mm512_movm_epi64(_mm512_movepi64_mask(v)));           /* DQ */
    __m256i w = _mm256_maskz_add_epi32(0x0f, _mm512_castsi512_si256(v), _mm256_set1_epi32(seed)); /* VL */
    r = _mm256_extract_epi32(w, 0);'
probe avx512_vbmi "-mavx512f -mavx512bw -mavx512vbmi" '__m512i v = _mm512_set1_epi8((char)seed); v = _mm512_permutexvar_epi8(v, v); r = _mm_cvtsi128_si32(_mm512_castsi512_si128(v));'
probe avx512_vnni "-mavx512f -mavx512vnni" '__m512i v = _mm512_set1_epi32(seed); v = _mm512_dpbusd_epi32(v, v, v); r = _mm_cvtsi128_si32(_mm512_castsi512_si128(v));'
probe avx512_bf16 "-mavx512f -mavx512bf16" '__m512 v = _mm512_set1_ps((float)seed); __m512bh b = _mm512_cvtne2ps_pbh(v, v); __m512 d = _mm512_dpbf16_ps(v, b, b); r = (int)_mm512_cvtss_f32(d);'
probe amx_tile "-mamx-tile" "$amx_setup"' _tile_stored(0, c, 64); _tile_release(); r = c[0];'
probe amx_int8 "-mamx-tile -mamx-int8" "$amx_setup"' _tile_dpbssd(0, 1, 2); _tile_stored(0, c, 64); _tile_release(); r = c[0];'
probe amx_bf16 "-mamx-tile -mamx-bf16" "$amx_setup"' _tile_dpbf16ps(0, 1, 2); _tile_stored(0, c, 64); _tile_release(); r = c[0];'

runs() { grep -qx "$1	runs" "$results"; }
flag() { if "$@"; then echo ON; else echo OFF; fi; }
# ggml compiles its AVX512 extensions only on top of AVX512 itself, and its AMX kernels need AMX-INT8 and
# AVX512-VNNI (amx.cpp: __AMX_INT8__ && __AVX512VNNI__).
avx512_runs() { runs avx512; }
with_avx512() { runs avx512 && runs "$1"; }
amx_usable() { runs amx_tile && runs amx_int8 && with_avx512 avx512_vnni; }
amx_bf16_usable() { amx_usable && runs amx_bf16; }
echo "-DGGML_NATIVE=OFF" \
    "-DGGML_SSE42=$(flag runs sse42)" "-DGGML_AVX=$(flag runs avx)" "-DGGML_AVX2=$(flag runs avx2)" \
    "-DGGML_FMA=$(flag runs fma)" "-DGGML_F16C=$(flag runs f16c)" "-DGGML_BMI2=$(flag runs bmi2)" \
    "-DGGML_AVX_VNNI=$(flag runs avx_vnni)" "-DGGML_AVX512=$(flag avx512_runs)" \
    "-DGGML_AVX512_VBMI=$(flag with_avx512 avx512_vbmi)" "-DGGML_AVX512_VNNI=$(flag with_avx512 avx512_vnni)" \
    "-DGGML_AVX512_BF16=$(flag with_avx512 avx512_bf16)" "-DGGML_AMX_TILE=$(flag amx_usable)" \
    "-DGGML_AMX_INT8=$(flag amx_usable)" "-DGGML_AMX_BF16=$(flag amx_bf16_usable)"
