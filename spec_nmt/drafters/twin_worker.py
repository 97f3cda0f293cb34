"""The twin's worker process: CTranslate2 in a process without torch, for runs of more than one
thread, where the two OpenMP runtimes in one process slow each other down (BENCHMARKS.md, "The
twin drafter"). Run as a script (it imports neither torch nor spec_nmt):

    python twin_worker.py TWIN_DIR COMPUTE_TYPE THREADS

It prints one line when the twin has loaded, then answers each request line, a JSON object
{"sources": [[piece, ...], ...], "prefixes": [[piece, ...], ...], "max_length": N}, with one
JSON line: each row's greedy hypothesis (prefix included), or {"error": message}.
"""

import json
import sys


def greedy_continuations(translator, sources, prefixes, max_length: int):
    """Each row's greedy hypothesis after its forced prefix (the prefix included), from a
    ``ctranslate2.Translator``; the twin drafter in a process with torch calls it too. With a
    prefix, CTranslate2's alternatives mode at one hypothesis gives the same greedy hypothesis
    but reads the prefix in one decoder pass instead of one step per token: a prefix of all but
    the last token cost 8 ms instead of 27 (newstest2014, batch 1, one thread). One difference:
    that mode never ends at its first position, so where greedy would end right after the
    prefix the draft holds a token that the lossless rule rejects, and the round ends with the
    verifier's EOS all the same (the relaxed rule, which drafts with the twin only when asked
    by name, judges it as any draft)."""
    alternatives = dict(return_alternatives=True, num_hypotheses=1) if any(prefixes) else {}
    results = translator.translate_batch(sources, target_prefix=prefixes, beam_size=1,
                                         max_decoding_length=max_length, **alternatives)
    return [result.hypotheses[0] for result in results]


def serve(directory: str, compute_type: str, threads: int) -> None:
    import ctranslate2

    translator = ctranslate2.Translator(directory, device="cpu", compute_type=compute_type,
                                        intra_threads=threads)  # fmt: skip
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = greedy_continuations(translator, request["sources"], request["prefixes"],
                                          request["max_length"])
        except (RuntimeError, ValueError) as error:
            answer = {"error": str(error)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
