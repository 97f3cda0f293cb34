"""The options of the model directory's interfaces that are not decoding settings (those live in
``spec_nmt.settings``): what drafts, in what precision, and how many sentences a batch holds, with
their values, defaults and help texts for spec-nmt-translate, the API, the task and the scripts.

It imports nothing heavy, so that the command line parses and refuses a wrong value before torch
and fairseq load.
"""

DEFAULT_BATCH_SIZE = 64

DRAFTER_PRECISION_NAMES = ("auto", "fp32", "bf16", "int8")
DEFAULT_DRAFTER_PRECISION = "auto"
DRAFTER_PRECISION_HELP = (
    "what the drafter's layers compute in: fp32 (the verifier's precision); bf16 (the cached "
    "drafter on the CPU: half the weight bytes, cheaper drafts); int8 (dynamic quantization of "
    "its feed-forward and output layers on the CPU). bf16 and int8 drafts depend a little on "
    "the batch, and so does relaxed top-beta/tau output with them; auto: bf16 where a cached "
    "drafter runs on a CPU that multiplies bf16 natively (AVX512-BF16 or AMX) in fp32, except "
    "for relaxed top-beta/tau, which drafts in fp32; else fp32. The verifier stays as it is, so "
    "every rule keeps its guarantee"
)


DRAFTER_CHOICES = ("auto", "twin", "file", "none")
DEFAULT_DRAFTER = "auto"
DRAFTER_HELP = (
    "what drafts: twin (the verifier's own CTranslate2 int8 twin, made once per verifier and "
    "kept in ~/.cache/spec-nmt/twins: whole continuations, no training; CPU only), file (the "
    "drafter checkpoint, --drafter-path), none (the verifier alone). auto: the twin for the "
    "lossless rule on the CPU, where it measured fastest, and the drafter file for the relaxed "
    "rule (the twin's drafts may depend on the batch), sampling (slower with the twin), RSD, "
    "draft trees and the GPU. Where the twin cannot be made (no ctranslate2, a verifier it cannot "
    "convert), one line says so and the drafter file drafts"
)
