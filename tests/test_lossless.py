"""The lossless property: --beta 1 --tau 0 output is token-identical to stock greedy decoding,
through fairseq-generate (its main in this process at batch 1 and 16, the console script with
draft trees), fairseq-interactive and the generator in-process, for
an untrained drafter, a trained one, an autoregressive one and an oracle drafter that proposes the
greedy answer."""

import re

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.sequence_generator import SequenceGenerator

from spec_nmt.checkpoint_loading import save_checkpoint
from spec_nmt.decoding import tree
from spec_nmt.decoding.loop import SpeculativeGenerator
from spec_nmt.decoding.scorer import BlockScorer
from spec_nmt.loading import load_drafter
from spec_nmt.settings import DecodingSettings
from spec_nmt.task import SpecTranslationConfig, SpecTranslationTask
from tests.conftest import BLOCK_SIZE, USER_DIR, fairseq, fairseq_in_process

MAX_LEN_B = 40
COMMON = ["--user-dir", USER_DIR, "--max-len-b", MAX_LEN_B, "--cpu"]
TEST_LINES = 60
# these tests check drafting in batches: by default the lossless rule drafts for one sentence only
DRAFT_IN_BATCHES = ["--max-draft-batch", 0]


def hypotheses(output):
    """{sentence id: hypothesis tokens} from H- lines."""
    found = {}
    for line in output.splitlines():
        if line.startswith("H-"):
            sentence_id, _score, *text = line.split("\t")
            found[int(sentence_id[2:])] = text[0] if text else ""
    return found


def mean_accepted(output):
    match = re.search(r"mean accepted tokens per iteration ([0-9.]+)", output)
    assert match, "no speculative decoding summary line"
    return float(match.group(1))


# what a trained toy drafter gets accepted at least, in drafts per iteration
LEAST_ACCEPTED = 0.3


def generate_flags(toy, batch_size, drafter=None, *extra):
    batching = ["--batch-size", batch_size, "--required-batch-size-multiple", 1]
    if drafter is None:
        task = ["--task", "translation", "--beam", 1]
    else:
        # a drafter file by name drafts (--drafter auto would let the verifier's twin draft)
        chosen = ["--drafter", "twin"] if drafter == "twin" else [
            "--drafter-path", toy[drafter], "--drafter", "file"]
        task = ["--task", "spec_translation", *chosen]
        task += ["--block-size", BLOCK_SIZE, "--beta", 1, "--tau", 0, *DRAFT_IN_BATCHES]
    return [toy["bin"], "--path", toy["verifier"], *task, *batching, *COMMON, *extra]


def generate(toy, batch_size, drafter=None, *extra):
    """fairseq-generate's output and log, run in this process (fairseq_in_process)."""
    return fairseq_in_process("generate", *generate_flags(toy, batch_size, drafter, *extra))


@pytest.fixture(scope="module")
def stock_greedy(toy):
    return {batch: hypotheses(generate(toy, batch)) for batch in (1, 16)}


@pytest.fixture(scope="module")
def drafting(toy):
    """generate(toy, batch, drafter), each run once for the tests that read it."""
    runs = {}

    def run(batch_size, drafter):
        if (batch_size, drafter) not in runs:
            runs[batch_size, drafter] = generate(toy, batch_size, drafter)
        return runs[batch_size, drafter]

    return run


@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize(
    "drafter",
    ["drafter", "untrained_drafter", "ar_drafter", "cached_drafter", "feature_drafter", "twin"],
)
def test_generate_is_identical_to_stock_greedy(stock_greedy, drafting, drafter, batch_size):
    output = drafting(batch_size, drafter)
    assert len(stock_greedy[batch_size]) == TEST_LINES
    assert hypotheses(output) == stock_greedy[batch_size]
    accepted = mean_accepted(output)
    if drafter != "untrained_drafter":
        assert accepted > LEAST_ACCEPTED  # a trained drafter gets drafts accepted
    print(f"{drafter} batch {batch_size}: mean accepted tokens per iteration {accepted}")


@pytest.mark.parametrize("batch_size", [1, 16])
def test_no_drafts_is_stock_greedy(toy, stock_greedy, batch_size):
    """--block-size 0: the verifier alone on the speculative loop, one token per call."""
    output = generate(toy, batch_size, "cached_drafter", "--block-size", 0)
    assert hypotheses(output) == stock_greedy[batch_size]
    assert mean_accepted(output) == 0


@pytest.mark.parametrize(
    "drafter, precision",
    [(drafter, precision) for drafter in ("drafter", "ar_drafter", "cached_drafter")
     for precision in ("fp32", "int8")] + [("cached_drafter", "bf16")],
)  # fmt: skip
def test_drafter_precision_keeps_lossless_decoding_lossless(toy, stock_greedy, drafter, precision):
    """--drafter-precision changes the drafts only: the verifier still decides every token, and
    each kind of drafter keeps its own adapter (its acceptance stays that of a trained
    drafter)."""
    output = generate(toy, 16, drafter, "--drafter-precision", precision)
    assert hypotheses(output) == stock_greedy[16]
    assert mean_accepted(output) > LEAST_ACCEPTED


def drafted_tokens(output):
    match = re.search(r"([0-9]+) drafted tokens", output)
    assert match, "no speculative decoding summary line"
    return int(match.group(1))


@pytest.mark.parametrize("drafter", ["cached_drafter", "feature_drafter"])
def test_a_draft_stop_drafts_less_and_keeps_lossless_decoding_lossless(toy, stock_greedy,
                                                                       drafting, drafter):
    """--draft-stop ends chains early (in one pass for the NAR cached drafter, step by step for
    the feature drafter; grow_tree's stop: test_tree.py): fewer drafts, the same greedy
    output."""
    stopped = generate(toy, 1, drafter, "--draft-stop", 0.5)
    assert hypotheses(stopped) == stock_greedy[1]
    assert 0 < drafted_tokens(stopped) < drafted_tokens(drafting(1, drafter))
    assert mean_accepted(stopped) > 0


def test_interactive_is_identical_to_stock_greedy(toy):
    lines = (toy["raw"] / "test.de").read_text()
    batching = ["--batch-size", 4, "--buffer-size", 8]
    stock = fairseq(
        "interactive", toy["bin"], "--task", "translation", "--path", toy["verifier"],
        "--beam", 1, *batching, *COMMON, input_text=lines,
    )  # fmt: skip
    spec = fairseq(
        "interactive", toy["bin"], "--task", "spec_translation", "--path", toy["verifier"],
        "--drafter-path", toy["drafter"], "--block-size", BLOCK_SIZE, *DRAFT_IN_BATCHES,
        *batching, *COMMON, input_text=lines,
    )  # fmt: skip
    expected = hypotheses(stock.stdout)
    assert len(expected) == TEST_LINES
    assert hypotheses(spec.stdout) == expected
    assert mean_accepted(spec.stderr + spec.stdout) > 0.3


def test_the_verifier_as_its_own_drafter_gets_every_draft_accepted(toy, stock_greedy, tmp_path):
    """The identical-drafter end (HF's test): the verifier as autoregressive drafter. The
    verifier's own file is refused as a drafter (a user's mistake), so the drafter is a copy
    with one weight moved by one float32 step: the same model for every decision here."""
    state = checkpoint_utils.load_checkpoint_to_cpu(str(toy["verifier"]))
    weight = state["model"]["decoder.layers.0.fc1.bias"]
    weight[0] = torch.nextafter(weight[0], torch.tensor(float("inf")))
    copy = tmp_path / "verifier-copy.pt"
    save_checkpoint(state, copy)
    output = generate(dict(toy, verifier_copy=copy), 16, "verifier_copy")
    assert hypotheses(output) == stock_greedy[16]
    # all k drafts + the bonus token per iteration: ceil((length + EOS) / (k + 1)) iterations
    lengths = [len(text.split()) + 1 for text in stock_greedy[16].values()]
    whole_blocks = sum(-(-length // (BLOCK_SIZE + 1)) for length in lengths)
    iterations = int(re.search(r"sentences, (\d+) iterations", output).group(1))
    assert whole_blocks <= iterations <= 1.05 * whole_blocks


class OracleDrafter:
    """Proposes the verifier's greedy continuation: every draft should be accepted."""

    def __init__(self, greedy_tokens, eos):
        self.greedy = greedy_tokens  # [B, T] greedy output per sentence, EOS-padded
        self.eos = eos

    def max_positions(self):
        return 1024

    def max_source_positions(self):
        return 1024

    def start(self, net_input, verifier_encoder_out, verifier_state=None):
        return {"rows": torch.arange(self.greedy.size(0))}  # original row of each state row

    def propose(self, state, tokens, lengths, plan, generator):
        rows = state["rows"]
        k = plan.depth
        padded = torch.cat(
            [self.greedy, self.greedy.new_full((self.greedy.size(0), k), self.eos)], 1
        )
        index = lengths.unsqueeze(1) + torch.arange(k)
        return tree.chain(padded[rows].gather(1, index))

    def commit(self, state, keep, n_keep):
        pass

    def check_depth(self, depth):
        pass

    def select_rows(self, state, keep):
        state["rows"] = state["rows"][keep]


@pytest.fixture(scope="module")
def in_process(toy):
    cfg = SpecTranslationConfig(
        data=str(toy["bin"]), source_lang="de", target_lang="en", block_size=BLOCK_SIZE,
        max_draft_batch=0, dataset_impl="mmap", required_seq_len_multiple=1,
    )  # fmt: skip
    task = SpecTranslationTask.setup_task(cfg)
    task.load_dataset("test")
    models, _ = checkpoint_utils.load_model_ensemble([str(toy["verifier"])], task=task)
    models[0].eval()
    batches = task.get_batch_iterator(
        task.dataset("test"), max_sentences=16, max_positions=(1024, 1024)
    ).next_epoch_itr(shuffle=False)
    return task, models, list(batches)


@torch.no_grad()
def test_oracle_drafter_gets_whole_blocks_accepted(in_process):
    task, models, batches = in_process
    tgt_dict = task.target_dictionary
    stock = SequenceGenerator(models, tgt_dict, beam_size=1, max_len_b=MAX_LEN_B)
    for sample in batches:
        greedy = [hypos[0]["tokens"] for hypos in stock.generate(models, sample)]
        greedy_padded = torch.nn.utils.rnn.pad_sequence(
            greedy, batch_first=True, padding_value=tgt_dict.eos()
        )
        speculative = SpeculativeGenerator(
            BlockScorer(models[0]),
            OracleDrafter(greedy_padded, tgt_dict.eos()),
            tgt_dict,
            DecodingSettings(block_size=BLOCK_SIZE, max_draft_batch=0, max_len_a=0,
                             max_len_b=MAX_LEN_B),
        )
        result = speculative.generate(models, sample)
        for expected, hypos in zip(greedy, result):
            assert hypos[0]["tokens"].tolist() == expected.tolist()
            # each iteration emits k accepted drafts + the bonus token, or ends at the EOS
            assert hypos[0]["spec_iterations"] == -(-len(expected) // (BLOCK_SIZE + 1))


def single_rows(task, sample):
    """Each sentence of a batch as a batch of its own, without the padding of the others."""
    net_input = sample["net_input"]
    for row in range(sample["id"].numel()):
        one = {"id": sample["id"][row : row + 1],
               "net_input": {k: v[row : row + 1] for k, v in net_input.items()}}  # fmt: skip
        src = one["net_input"]["src_tokens"]
        keep = src.ne(task.source_dictionary.pad()).squeeze(0)
        one["net_input"]["src_tokens"] = src[:, keep]
        one["net_input"]["src_lengths"] = keep.sum().view(1)
        yield one


def decode(in_process, generator, batch_size):
    """{sentence id: output tokens} of the test split in batches of 16 or one by one."""
    task, models, batches = in_process
    if batch_size == 1:
        batches = [one for batch in batches for one in single_rows(task, batch)]
    return {int(i): hypos[0]["tokens"].tolist() for sample in batches
            for i, hypos in zip(sample["id"], generator.generate(models, sample))}  # fmt: skip


@pytest.fixture(scope="module")
def stock_greedy_in_process(in_process):
    task, models, _ = in_process
    stock = SequenceGenerator(models, task.target_dictionary, beam_size=1, max_len_b=MAX_LEN_B)
    greedy = {batch: decode(in_process, stock, batch) for batch in (1, 16)}
    assert len(greedy[1]) == len(greedy[16]) == TEST_LINES
    return greedy


@pytest.mark.parametrize("shape", [{"tree_branching": "3,2,1"},
                                   {"block_size": 3, "tree_budget": 9}])  # fmt: skip
@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize("drafter", ["drafter", "ar_drafter", "cached_drafter", "feature_drafter"])
@torch.no_grad()
def test_greedy_draft_trees_are_identical_to_stock_greedy(in_process, stock_greedy_in_process, toy,
                                                          drafter, batch_size, shape):
    """Greedy draft trees with top_beta: each node's children are the drafter's best tokens
    (tree_branching) or the sequences a beam search over the drafter keeps (tree_budget); the
    verifier scores the tree in one pass and follows its own picks down it; more drafts are
    accepted than along the chain of the same depth."""
    task, models, _ = in_process
    adapter = load_drafter(task, str(toy[drafter]), models[0])
    lossless = DecodingSettings(block_size=BLOCK_SIZE, max_draft_batch=0, max_len_a=0,
                                max_len_b=MAX_LEN_B)  # fmt: skip
    accepted = {}
    for name, settings in (("chain", lossless.replace(block_size=3)),
                           ("tree", lossless.replace(**shape))):  # fmt: skip
        generator = task.generator_for(models[0], adapter, settings)
        output = decode(in_process, generator, batch_size)
        assert output == stock_greedy_in_process[batch_size]
        accepted[name] = generator.stats.mean_accepted_per_iteration
    assert accepted["tree"] > accepted["chain"]


def test_draft_tree_flags_decode_like_stock_greedy_through_fairseq_generate(toy, stock_greedy):
    """The tree flags of the lossless rule, end to end (the shapes themselves: above)."""
    result = fairseq("generate", *generate_flags(toy, 16, "cached_drafter", "--tree-branching",
                                                 "3,2,1"))  # fmt: skip
    output = result.stdout + result.stderr
    assert hypotheses(output) == stock_greedy[16]
    assert mean_accepted(output) > LEAST_ACCEPTED


def task_generator(task, models, drafter):
    """The generator the task builds for fairseq-generate, with the drafter file ``drafter``
    (--drafter file)."""
    task.cfg.drafter_path, task.cfg.drafter = str(drafter), "file"
    try:
        return task.build_generator(models, SpecTranslationConfig())
    finally:
        task.cfg.drafter_path, task.cfg.drafter = None, "auto"


@torch.no_grad()
def test_batch_composition_does_not_change_translations(in_process, toy):
    """Mixed batches against one sentence at a time, through the task-built generator."""
    task, models, batches = in_process
    generator = task_generator(task, models, toy["drafter"])
    sample = batches[0]
    results = [h[0] for h in generator.generate(models, sample)]
    together = [h["tokens"].tolist() for h in results]
    # the totals count every sentence once, whenever it finished and left the batch
    stats = generator.stats
    assert stats.sentences == len(results) == 16
    assert stats.iterations == sum(h["spec_iterations"] for h in results)
    assert stats.accepted_tokens == sum(h["spec_accepted_tokens"] for h in results)
    assert stats.output_tokens == sum(len(tokens) for tokens in together)
    assert stats.accepted_tokens <= stats.drafted_tokens <= BLOCK_SIZE * stats.iterations
    assert len({h["spec_iterations"] for h in results}) > 1  # rows finished at different times
    for row, one in enumerate(single_rows(task, sample)):
        alone = generator.generate(models, one)[0][0]["tokens"].tolist()
        assert alone == together[row], f"sentence {int(sample['id'][row])}"


@torch.no_grad()
def test_an_empty_source_counts_as_its_eos_in_the_statistics(in_process, toy):
    task, models, batches = in_process
    generator = task_generator(task, models, toy["drafter"])
    net_input = dict(batches[0]["net_input"])
    src = net_input["src_tokens"].clone()
    src[1] = task.source_dictionary.pad()
    src[1, -1] = task.source_dictionary.eos()  # left-padded, as fairseq batches sources
    net_input["src_tokens"] = src
    net_input["src_lengths"] = net_input["src_lengths"].clone().index_fill_(0, torch.tensor([1]), 1)
    results = [h[0] for h in generator.generate(models, {"net_input": net_input})]
    assert results[1]["tokens"].tolist() == [task.target_dictionary.eos()]
    stats = generator.stats
    assert stats.output_tokens == sum(len(h["tokens"]) for h in results)
    assert stats.iterations == sum(h.get("spec_iterations", 0) for h in results) > 0


@torch.no_grad()
def test_by_default_a_batch_decodes_without_drafts_and_one_sentence_drafts(in_process, toy,
                                                                          monkeypatch):
    """The default drafting batch limit (one sentence for the lossless rule): a batch of 16 runs
    the verifier alone, the same sentences one at a time draft, and the translations agree."""
    task, models, batches = in_process
    with monkeypatch.context() as patch:
        patch.setattr(task.cfg, "max_draft_batch", None)
        generator = task_generator(task, models, toy["drafter"])
    assert generator.settings.draft_batch_limit() == 1
    sample = batches[0]
    together = [h[0]["tokens"].tolist() for h in generator.generate(models, sample)]
    assert generator.stats.drafted_tokens == 0 and generator.stats.batches_without_drafts == 1
    assert generator.stats.iterations == generator.stats.output_tokens  # a token per iteration
    drafting = task_generator(task, models, toy["drafter"])  # max_draft_batch 0: drafts always
    assert [h[0]["tokens"].tolist() for h in drafting.generate(models, sample)] == together
    assert drafting.stats.drafted_tokens > 0
    net_input = sample["net_input"]
    keep = net_input["src_tokens"][0].ne(task.source_dictionary.pad())
    one = {"net_input": {"src_tokens": net_input["src_tokens"][:1, keep],
                         "src_lengths": keep.sum().view(1)}}  # fmt: skip
    assert generator.generate(models, one)[0][0]["tokens"].tolist() == together[0]
    assert generator.stats.drafted_tokens > 0
