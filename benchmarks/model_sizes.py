"""Mode sizes: what the loop earns by verifier size, acceptance and batch size, for a fairseq user
to predict the speed-up on their own model. Per size (the bundled verifier, and transformer-base
and transformer-big with random weights and the bundled dictionaries), per batch size: stock
fairseq greedy, the drafter-less loop (dynamic and static), and an oracle drafter that gets
exactly ``a`` drafts accepted per iteration (k = a, every draft the verifier's own greedy token,
so each iteration emits a + 1 tokens), decoding newstest sentences to a fixed output length
(--output-length tokens, then EOS: random weights give no translation to end). The bundled size
adds its real drafter (lossless, k = 3, drafting in every batch)."""

import argparse
import copy
import json

import torch
from common import (
    decode_all,
    environment,
    load_inputs,
    oracle,
    other_loop,
    speculating,
    table,
    write_result,
)
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer.transformer_legacy import (
    transformer_vaswani_wmt_en_de_big,
    transformer_wmt_en_de,
)
from fairseq.sequence_generator import SequenceGenerator

from spec_nmt.translator import SpecTranslator

# fairseq's architectures of the sizes users run, by the name the table gives them
ARCHITECTURES = {"base": transformer_wmt_en_de, "big": transformer_vaswani_wmt_en_de_big}


def sized_pair(pair: SpecTranslator, size: str, length: int) -> SpecTranslator:
    """The bundled pair with its verifier replaced by a random one of ``size`` (or kept, for
    "bundled"), every setting decoding exactly ``length`` tokens and EOS."""
    fixed = dict(max_len_a=0, max_len_b=length, min_len=length)
    sized = copy.copy(pair)
    sized.settings = pair.settings.replace(**fixed)
    if size != "bundled":
        args = argparse.Namespace(share_all_embeddings=False,
                                  share_decoder_input_output_embed=True)  # fmt: skip
        ARCHITECTURES[size](args)
        torch.manual_seed(1)
        verifier = TransformerModel.build_model(args, pair.task)
        parameter = next(pair.verifier.parameters())
        sized.verifier = verifier.to(device=parameter.device, dtype=parameter.dtype).eval()
    return sized


def fixed_length_greedy(pair: SpecTranslator, length: int) -> SequenceGenerator:
    return SequenceGenerator([pair.verifier], pair.tgt_dict, beam_size=1, max_len_a=0,
                             max_len_b=length, min_len=length)  # fmt: skip


def size_systems(args, pair, tokens, alone, size):
    other = other_loop(pair)
    systems = {"fairseq greedy": fixed_length_greedy(pair, args.output_length),
               f"spec-nmt greedy (no drafts), {other} loop": pair.generator(
                   block_size=0, decoding_loop=other),
               "spec-nmt greedy (no drafts)": pair.generator(block_size=0)}  # fmt: skip
    for accepted in args.oracle_accepts:
        if accepted:
            systems[f"oracle, {accepted} accepted per iteration"] = oracle(pair, tokens, alone,
                                                                           accepted)  # fmt: skip
    if size == "bundled":
        systems["spec lossless, real drafter k=3"] = speculating(pair, block_size=3)
    return systems


def model_sizes(args):
    base_pair, src, _, tokens = load_inputs(args)
    rows = []
    for size in args.sizes:
        pair = sized_pair(base_pair, size, args.output_length)
        parameters = sum(p.numel() for p in pair.verifier.parameters())
        alone = decode_all(pair, {"greedy": fixed_length_greedy(pair, args.output_length)},
                           tokens, 1)["greedy"]["tokens"]  # fmt: skip
        for batch_size in args.batch_sizes:
            systems = size_systems(args, pair, tokens, alone, size)
            decode_all(pair, systems, tokens[: args.warmup_lines], batch_size)
            if pair.device.type == "cuda":  # the graphs captured before the timed run
                decode_all(pair, {name: g for name, g in systems.items()
                                  if getattr(g, "on_static_loop", False)}, tokens, batch_size)
            results = decode_all(pair, systems, tokens, batch_size)
            base = results["fairseq greedy"]
            output_tokens = sum(t.numel() for t in base["tokens"])
            for name, result in results.items():
                row = {"size": size, "parameters_millions": round(parameters / 1e6, 1),
                       "batch_size": batch_size, "system": name,
                       "ms_per_output_token": round(1000 * result["seconds"] / output_tokens, 3),
                       "speedup_vs_greedy": round(base["seconds"] / result["seconds"], 2),
                       "identical_to_greedy": sum(torch.equal(a, b) for a, b in
                                                  zip(result["tokens"], alone))}  # fmt: skip
                if "tokens_per_verifier_call" in result:
                    row["tokens_per_verifier_call"] = result["tokens_per_verifier_call"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"mode": "sizes", "lines": len(src), "output_length": args.output_length,
              "environment": environment(args, base_pair), "rows": rows}  # fmt: skip
    columns = [("size", "size"), ("parameters_millions", "M parameters"), ("batch_size", "batch"),
               ("system", "system"), ("ms_per_output_token", "ms/token"),
               ("speedup_vs_greedy", "× greedy"), ("tokens_per_verifier_call", "tokens/iteration"),
               ("identical_to_greedy", f"= greedy (of {len(src)})")]  # fmt: skip
    print(table(columns, rows))
    write_result(args, result)
