"""Every setting of speculative decoding in one frozen dataclass, with the one set of defaults
that the task's flags, the Python API, ``spec-nmt-translate``, ``make translate``, the benchmark,
the trace and distillation share. Checking a setting and turning the rule's flags into a draft
shape happen here, once."""

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, List, NamedTuple, Optional, Sequence, Tuple

if TYPE_CHECKING:  # torch is not imported here: the command line parses with these settings
    from torch import Tensor

from spec_nmt.errors import SpecNmtError


class RuleDrafts(NamedTuple):
    """The drafts an acceptance rule (``--verify``) judges; how it judges them is in
    decoding/rules.py, under the same name."""

    sampled: bool  # drafts drawn from the drafter (else its best tokens); the rule samples
    trees: bool  # drafts may branch (else always a chain of block_size)
    # the tree drawn when no tree flag is given (--tree-branching's form); None: a chain
    default_branching: Optional[str] = None


VERIFY_RULES = {
    "top_beta": RuleDrafts(sampled=False, trees=True),
    "sampling": RuleDrafts(sampled=True, trees=False),
    # RSD-C 3,1: the most tokens per verifier call of the 6-node trees on newstest2013
    # (BENCHMARKS.md)
    "rsd": RuleDrafts(sampled=True, trees=True, default_branching="3,1"),
}


def samples(verify: str) -> bool:
    """Whether rule ``verify`` samples (else it translates greedily)."""
    return VERIFY_RULES[verify].sampled


@dataclass(frozen=True)
class Caller:
    """How a caller names settings in a message: flags on a command line, keywords in Python.
    ``samples_with`` is how it asks for samples instead of a greedy translation."""

    name: Callable[..., str]  # (setting, value=None) -> the setting (with the value) as given
    samples_with: str


def _flag(setting: str, *value) -> str:
    return " ".join([f"--{setting.replace('_', '-')}", *map(str, value)])


def _keyword(setting: str, *value) -> str:
    return f"{setting}={value[0]!r}" if value else setting


FLAGS = Caller(_flag, "add --verify sampling or --verify rsd")
KEYWORDS = Caller(_keyword, "call sample() instead of translate()")


class SettingError(SpecNmtError):
    """A bad setting, worded for whoever gave it: ``message(caller)`` writes the one line. Its
    text names flags (the command lines print it as it is); ``for_caller(KEYWORDS)`` gives the
    same error for the Python API, naming keywords."""

    def __init__(self, message: Callable[[Caller], str], caller: Caller = FLAGS):
        super().__init__(message(caller))
        self.message = message

    def for_caller(self, caller: Caller) -> "SettingError":
        return SettingError(self.message, caller)

    def __reduce__(self):  # (the message function does not pickle; its text does)
        return SpecNmtError, (str(self),)


@dataclass(frozen=True)
class DraftPlan:
    """The shape of the drafts. ``branching`` gives the children per node at each depth
    (``(1,) * k`` is a chain); ``beam_width`` > 0 instead grows ``depth`` levels of beam search
    (stochastic when sampling). ``sample`` draws tokens from p (without replacement among
    siblings); otherwise nodes hold the drafter's best tokens (or most probable sequences)."""

    branching: Tuple[int, ...] = ()
    beam_width: int = 0
    beam_depth: int = 0
    sample: bool = False
    # a chain ends after the first level at which no row's draft has at least this probability
    # under the drafter (0: every chain is ``depth`` long); see drafter.goes_on
    stop_below: float = 0.0

    @property
    def depth(self) -> int:
        return self.beam_depth if self.beam_width else len(self.branching)

    @property
    def is_chain(self) -> bool:
        return not self.beam_width and all(b == 1 for b in self.branching)

    @classmethod
    def chain(cls, k: int, sample: bool, stop_below: float = 0.0) -> "DraftPlan":
        return cls(branching=(1,) * k, sample=sample, stop_below=stop_below)

    def shrink(self, depth: int) -> "DraftPlan":
        """The same plan at most ``depth`` levels deep (near the position limit)."""
        if self.beam_width:
            return DraftPlan(beam_width=self.beam_width, beam_depth=min(depth, self.beam_depth),
                             sample=self.sample)  # fmt: skip
        return DraftPlan(branching=self.branching[:depth], sample=self.sample,
                         stop_below=self.stop_below)  # fmt: skip


@dataclass(frozen=True)
class DecodingSettings:
    """What a speculative generator needs to know besides its models. Each field's help is the
    one text of its flag: the task's config (``--verify`` ...), ``spec-nmt-translate`` and the
    benchmark take it from here."""

    # the rule and the drafts
    verify: str = field(default="top_beta", metadata={"kind": "rule", "help": (
        "acceptance rule: top_beta (greedy drafts judged by --beta and --tau; lossless with the "
        "defaults), sampling (speculative sampling of a chain: samples exactly from the "
        "verifier) or rsd (recursive rejection sampling over a draft tree, as exact)")})
    # With the bundled pair 2 and 3 are the fastest k > 0, 5 and 10 slower
    # (BENCHMARKS.md, newstest2014); its drafter earns little after 3.
    block_size: int = field(default=3, metadata={"kind": "rule", "help": (
        "k: drafted tokens per iteration (tree depth for rsd); 0: no drafts, the verifier alone "
        "on the same loop")})
    beta: int = field(default=1, metadata={"kind": "rule", "help": (
        "top-beta rule: a draft must be among the verifier's beta best tokens (1: its best, "
        "which makes the output the verifier's greedy translation whatever --tau)")})
    tau: float = field(default=0.0, metadata={"kind": "rule", "help": (
        "top-beta rule: a draft's log-probability must also be at most tau below the best "
        "token's, in nats (natural log)")})
    # children per node at each depth: rsd's RSD-C tree, or a tree of the drafter's best tokens
    # for top_beta (chains without it or tree_budget)
    tree_branching: Optional[str] = field(default=None, metadata={"kind": "rule", "help": (
        "a draft tree instead of a chain: children per node at each depth, e.g. 3,2,2,1 "
        "(top_beta: the drafter's best tokens; rsd: drawn tokens, RSD-C)")})
    # nodes per iteration, grown by beam search over the drafter's sequences (stochastic for
    # rsd: RSD-S); block_size levels of tree_budget // block_size nodes each
    tree_budget: int = field(default=0, metadata={"kind": "rule", "help": (
        "a draft tree grown by beam search over the drafter's sequences: nodes per iteration, "
        "block-size levels of tree-budget // block-size nodes (rsd: stochastic, RSD-S; 0: none)")})
    # Drafts the drafter is unsure of are seldom accepted: with the feature drafter, whose every
    # draft is a step, stopping there drafts fewer and accepts about as many (BENCHMARKS.md)
    draft_stop: float = field(default=0.0, metadata={"kind": "rule", "help": (
        "end a chain of drafts after the first level where no sentence's draft has at least "
        "this probability under the drafter; --block-size stays the most (0: always "
        "block-size drafts)")})
    # a larger batch decodes with the verifier alone on the same loop: drafts cost more than
    # they earn in a batch (BENCHMARKS.md). None: resolved by draft_batch_limit
    max_draft_batch: Optional[int] = field(default=None, metadata={"kind": "rule", "help": (
        "the most sentences a batch may have and still draft; larger batches decode with the "
        "verifier alone (0: draft in every batch; default: for the lossless rule and the "
        "sampling rules 1 with a drafter file, and with the twin 8 on a CPU with AVX-512 and "
        "4 on others, where each measured fastest; no limit for a relaxed --beta/--tau)")})
    # Both loops give the same tokens (SpeculativeGenerator.execution picks a batch's loop).
    # auto picks by device: on the CPU, where a host read costs nothing, the dynamic loop ran
    # 3-5 % faster with drafts and tied without (BENCHMARKS.md, "The loop on the CPU").
    decoding_loop: str = field(default="auto", metadata={"kind": "rule", "help": (
        "static: preallocated caches, acceptance on the device and one host read per "
        "iteration (captured as a CUDA graph on a GPU), for the top_beta rule with chains of "
        "drafts; other rules and draft shapes decode on the dynamic loop. dynamic: always the "
        "dynamic loop. auto: static on a GPU, dynamic on the CPU (the faster one on each; "
        "same output)")})
    # sampling (rules sampling and rsd)
    temperature: float = field(default=1.0, metadata={"kind": "sampling", "help": (
        "sampling rules: the verifier's logits are divided by it (below 1: closer to greedy)")})
    sampling_topk: int = field(default=-1, metadata={"kind": "sampling", "help": (
        "sampling rules: sample among the k most probable tokens only (-1: all)")})
    sampling_topp: float = field(default=-1.0, metadata={"kind": "sampling", "help": (
        "sampling rules: sample among the most probable tokens whose probabilities add up to p "
        "(-1: all)")})
    seed: int = field(default=1, metadata={"kind": "sampling", "help": (
        "sampling rules: the random seed; equal seeds give equal samples")})
    # output length and scores, in fairseq's generation terms
    max_len_a: float = 1.2  # an output may have max_len_a * source length + max_len_b tokens
    max_len_b: int = 10
    min_len: int = 1
    lenpen: float = 1.0
    unkpen: float = 0.0
    unnormalized: bool = False

    def __post_init__(self):
        # Every check of a setting is here, once; each message names settings through ``n``,
        # so that each caller reads its own names (SettingError).
        if self.verify not in VERIFY_RULES:
            raise SettingError(lambda n: f"{n.name('verify')} must be one of "
                               f"{', '.join(VERIFY_RULES)}, got {self.verify!r}")  # fmt: skip
        if int(self.block_size) != self.block_size or self.block_size < 0:
            raise SettingError(lambda n: f"{n.name('block_size')} must be an integer >= 0 "
                               f"(0: no drafts), got {self.block_size}")  # fmt: skip
        if int(self.beta) != self.beta or self.beta < 1:
            raise SettingError(
                lambda n: f"{n.name('beta')} must be an integer >= 1, got {self.beta}"
            )
        if not self.tau >= 0:  # (also refuses NaN)
            raise SettingError(lambda n: f"{n.name('tau')} must be >= 0, got {self.tau}")
        if self.decoding_loop not in DECODING_LOOPS:
            raise SettingError(lambda n: f"{n.name('decoding_loop')} must be one of "
                               f"{', '.join(DECODING_LOOPS)}, got {self.decoding_loop!r}")
        if not 0 <= self.draft_stop < 1:
            raise SettingError(lambda n: f"{n.name('draft_stop')} must be in [0, 1) (0: no "
                               f"stop), got {self.draft_stop}")  # fmt: skip
        self._check_max_draft_batch()
        self._check_sampling()
        self.draft_plan  # noqa: B018  (refuses tree flags that make no shape)

    def _check_sampling(self) -> None:
        """Refuse sampling settings no distribution can be made from."""
        if not self.temperature > 0:
            raise SettingError(lambda n: f"{n.name('temperature')} must be > 0, "
                               f"got {self.temperature}")  # fmt: skip
        topk = self.sampling_topk
        if int(topk) != topk or (topk < 1 and topk != -1):
            raise SettingError(lambda n: f"{n.name('sampling_topk')} must be a positive "
                               f"integer (or -1 for all), got {topk}")  # fmt: skip
        topp = self.sampling_topp
        if topp != -1.0 and not 0 < topp <= 1:
            raise SettingError(lambda n: f"{n.name('sampling_topp')} must be in (0, 1] "
                               f"(or -1 for all), got {topp}")  # fmt: skip

    @property
    def relaxed(self) -> bool:
        """Whether the rule's translations depend on the drafts: top-beta with beta > 1 (with
        beta 1 only the verifier's best token passes, whatever tau); lossless top-beta and the
        sampling rules give the verifier's own."""
        return self.verify == "top_beta" and self.beta > 1

    def draft_batch_limit(self, drafter=None) -> int:
        """The most sentences a batch drafts for (0: any number), ``max_draft_batch`` resolved
        for ``drafter``: its own ``default_draft_batch`` where it has one (the twin's drafts pay
        in larger batches than a trained drafter's)."""
        if self.max_draft_batch is not None:
            return self.max_draft_batch
        return 0 if self.relaxed else getattr(drafter, "default_draft_batch", DEFAULT_DRAFT_BATCH)

    def _check_max_draft_batch(self) -> None:
        limit = self.max_draft_batch
        if limit is None:
            return
        if int(limit) != limit or limit < 0:
            raise SettingError(lambda n: f"{n.name('max_draft_batch')} must be an integer >= 0 "
                               f"(0: draft in batches of any size), got {limit}")  # fmt: skip
        if limit and self.relaxed:
            raise SettingError(
                lambda n: f"{n.name('max_draft_batch', limit)} with a relaxed top-beta/tau "
                f"({n.name('beta', self.beta)}) would make a sentence's translation depend on "
                "its batch (the drafts decide it): use 0 (draft in every batch) or the lossless "
                "rule"
            )

    @functools.cached_property  # (the rules ask it every iteration)
    def draft_plan(self) -> DraftPlan:
        """The drafts' shape; one-line errors for combinations that make no sense."""
        rule = VERIFY_RULES[self.verify]
        trees = "({}, {}, {})".format  # the settings that make a draft tree
        if not rule.trees and (self.tree_branching or self.tree_budget):
            raise SettingError(
                lambda n: f"{n.name('verify', self.verify)} drafts a chain: "
                f"{n.name('tree_branching')} and {n.name('tree_budget')} need "
                f"{n.name('verify', 'top_beta')} or {n.name('verify', 'rsd')}"
            )
        if self.tree_branching and self.tree_budget:
            raise SettingError(
                lambda n: f"a draft tree takes one of {n.name('tree_branching')} (children per "
                f"node at each depth, e.g. 3,2,2,1) and {n.name('tree_budget')} (nodes per "
                "iteration, beam search), not both"
            )
        branches = bool(self.tree_branching or self.tree_budget or rule.default_branching)
        if self.block_size == 0 and branches:
            raise SettingError(
                lambda n: f"{n.name('block_size', 0)} (no drafts) decodes with the verifier "
                "alone: it takes no draft tree " + trees(
                    n.name('verify', 'rsd'), n.name('tree_branching'), n.name('tree_budget'))
            )
        if branches and self.draft_stop:
            raise SettingError(
                lambda n: f"{n.name('draft_stop')} ends chains of drafts: it takes no draft "
                "tree " + trees(
                    n.name('verify', 'rsd'), n.name('tree_branching'), n.name('tree_budget'))
            )
        if not branches:
            return DraftPlan.chain(self.block_size, rule.sampled, self.draft_stop)
        if not self.tree_budget:
            shape = self.tree_branching or rule.default_branching
            try:
                branching = tuple(int(part) for part in shape.split(","))
            except ValueError:
                branching = ()
            if not branching or min(branching) < 1:
                raise SettingError(
                    lambda n: f"{n.name('tree_branching')} must be comma-separated positive "
                    f"integers (children per node at each depth, e.g. 3,2,2,1), got "
                    f"{self.tree_branching!r}"
                )
            return DraftPlan(branching=branching, sample=rule.sampled)
        width = self.tree_budget // self.block_size
        if width < 1:
            raise SettingError(
                lambda n: f"{n.name('tree_budget', self.tree_budget)} is smaller than "
                f"{n.name('block_size', self.block_size)}: the beam needs at least one node per "
                "level"
            )
        return DraftPlan(beam_width=width, beam_depth=self.block_size, sample=rule.sampled)

    def length_limits(self, source_lengths: "Tensor", max_positions: int) -> "Tensor":
        """Each sentence's output length limit [B], max_len_a * its source length + max_len_b
        in SequenceGenerator's arithmetic (a double, truncated), at most ``max_positions`` - 1,
        computed where ``source_lengths`` [B] lie (on the device: no wait for the host)."""
        limits = (self.max_len_a * source_lengths.double() + self.max_len_b).trunc().long()
        return limits.clamp(max=max_positions - 1)

    def replace(self, **changes) -> "DecodingSettings":
        """A copy with ``changes``, the Python API's way to set them: an error names keywords,
        and an unknown name is a one-line error listing the known ones."""
        unknown = set(changes) - set(names())
        if unknown:
            raise SpecNmtError(
                f"unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(names())}"
            )
        try:
            return dataclasses.replace(self, **changes)
        except SettingError as error:
            raise error.for_caller(KEYWORDS) from None

    @classmethod
    def from_fairseq(cls, cfg, args, seed: int) -> "DecodingSettings":
        """The settings of a fairseq run: the rule's flags from the task config ``cfg``, the
        generation flags from fairseq's ``args`` (its own defaults where it has them)."""
        rule = {name: getattr(cfg, name) for name in RULE_SETTINGS}
        generation = {name: getattr(args, name) for name in GENERATION_SETTINGS
                      if hasattr(args, name)}  # fmt: skip
        return cls(**rule, **generation, seed=seed)

    def fairseq_flags(self, settings: Sequence[str]) -> List[str]:
        """The named ones of these settings as fairseq command-line flags."""
        flags = []
        for name in settings:
            value = getattr(self, name)
            if isinstance(value, bool):
                flags += [f"--{name.replace('_', '-')}"] if value else []
            else:
                flags += [f"--{name.replace('_', '-')}", str(value)]
        return flags


def names() -> List[str]:
    return [setting.name for setting in dataclasses.fields(DecodingSettings)]


def flag_help(name: str, with_default: bool = True) -> str:
    """A setting's help text for its command-line flag, with its default unless that is None
    (a default that depends on other settings, which the text explains)."""
    setting = next(s for s in dataclasses.fields(DecodingSettings) if s.name == name)
    text = setting.metadata["help"]
    if with_default and setting.default is not None:
        shown = f"{setting.default:g}" if isinstance(setting.default, float) else setting.default
        text += f" (default: {shown})"
    return text


DECODING_LOOPS = ("auto", "static", "dynamic")
# The default largest drafting batch of the rules whose translations the drafts cannot change:
# the bundled pair's drafts about pay for themselves for one sentence and lose from two on
# (BENCHMARKS.md, "Speed by batch size").
DEFAULT_DRAFT_BATCH = 1
DEFAULTS = DecodingSettings()
# The relaxed top-beta/tau rule (beta, tau) that the acceptance targets quote: drafters are
# validated and benchmarked with it beside the lossless rule, at their own k.
REFERENCE_TOP_BETA = DEFAULTS.replace(beta=3, tau=1.0)


def settings_of_kind(kind: Optional[str]) -> Tuple[str, ...]:
    """The settings whose field says this ``kind``: "rule" (the task's own flags), "sampling"
    (only the sampling rules use them) or None (fairseq's generation flags alone)."""
    return tuple(setting.name for setting in dataclasses.fields(DecodingSettings)
                 if setting.metadata.get("kind") == kind)  # fmt: skip


# the task's own flags; the rest are fairseq's generation flags (--temperature, --max-len-a ...)
RULE_SETTINGS = settings_of_kind("rule")
# the settings only the sampling rules use (and what fairseq's --sampling reads)
SAMPLING_SETTINGS = settings_of_kind("sampling")
GENERATION_SETTINGS = tuple(name for name in names() if name not in RULE_SETTINGS + ("seed",))


def check_sampling_settings_used(verify: str, given: Iterable[str], caller: Caller) -> None:
    """Refuse sampling settings given for a run or call that decodes greedily: they would be
    ignored, and a user who gives them meant to sample."""
    given = [name for name in SAMPLING_SETTINGS if name in given]
    if given and not samples(verify):
        raise SettingError(
            lambda n: f"{', '.join(map(n.name, given))} {'sets' if len(given) == 1 else 'set'} "
            "how to sample: "
            f"{n.samples_with} ({n.name('verify', verify)} translates greedily)",
            caller,
        )
