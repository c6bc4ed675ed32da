"""The /proc/cpuinfo flag lines of the three kinds of x86 machine seen so far (for tests that fake a CPU)."""

COMMON = "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt aes xsave avx f16c bmi1 bmi2 avx2 fma"
KINDS = {
    # AMD EPYC Zen 3: AVX2 only
    "zen3": COMMON + " sha_ni vaes vpclmulqdq",
    # AMD EPYC Zen 4: AVX-512 with BF16, no AMX
    "zen4": COMMON + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni avx512vbmi",
    # Intel Xeon (Sapphire Rapids on): AVX-512 BF16 and AMX
    "xeon": COMMON + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile amx_int8",
}
