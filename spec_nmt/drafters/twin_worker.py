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


def serve(directory: str, compute_type: str, threads: int) -> None:
    import ctranslate2

    translator = ctranslate2.Translator(directory, device="cpu", compute_type=compute_type,
                                        intra_threads=threads)  # fmt: skip
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            results = translator.translate_batch(
                request["sources"], target_prefix=request["prefixes"], beam_size=1,
                max_decoding_length=request["max_length"])
            answer = [result.hypotheses[0] for result in results]
        except (RuntimeError, ValueError) as error:
            answer = {"error": str(error)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
