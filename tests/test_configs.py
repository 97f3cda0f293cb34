"""The hydra configs under configs/ and the shell recipes (scripts/train_*.sh) describe the same
trainings: every flag a recipe passes to fairseq-train has the same value in its YAML file."""

import re
import shlex

import pytest
from omegaconf import OmegaConf

from tests.conftest import REPO

# flags whose values are paths or the command's own arguments, not training settings
RUN_FLAGS = {"--save-dir", "--user-dir"}


def recipe_flags(script: str, preset: str) -> dict:
    """Flag -> value (True for a switch) that ``script`` passes for ``preset``: the shared flags
    of train_common.sh, the script's task and criterion, then the preset's (later ones win)."""
    common = (REPO / "scripts" / "train_common.sh").read_text()
    shared = re.search(r"exec fairseq-train \S+ (.*?)\"\$@\"", common, re.S).group(1)
    text = (REPO / "scripts" / script).read_text()
    call = re.search(r"^fairseq_train (.*?)\"\$\{MODEL", text, re.S | re.M).group(1)
    model = re.search(rf"^\s*{preset}\)\s+MODEL=\((.*?)\) ;;", text, re.S | re.M).group(1)
    words = shlex.split(" ".join((shared, call, model)).replace("\\\n", " "))
    flags, i = {}, 0
    while i < len(words):
        flag = words[i]
        assert flag.startswith("--"), f"{script} {preset}: unexpected word {flag!r}"
        value = True
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            value, i = words[i + 1], i + 1
        flags[flag], i = value, i + 1
    return {flag: value for flag, value in flags.items() if flag not in RUN_FLAGS}


def yaml_value(config: dict, flag: str):
    """The value of fairseq flag ``flag`` in a hydra config (None if it is not set there)."""
    name = flag[2:].replace("-", "_")
    if name == "arch":
        return config["model"]["_name"]
    if name in ("task", "criterion", "optimizer", "lr_scheduler"):
        return config[name]["_name"]
    if name in ("lr", "update_freq"):
        value = config["optimization"].get(name)
        return value[0] if value else None
    for section in config.values():
        if isinstance(section, dict) and name in section:
            return section[name]
    return None


def same(recipe_value, config_value) -> bool:
    if recipe_value is True or isinstance(config_value, bool):
        return recipe_value is config_value
    try:  # numbers in any spelling (YAML reads 1e-07 as a string)
        return float(recipe_value) == float(config_value)
    except (TypeError, ValueError):
        return str(recipe_value).replace(" ", "") == str(config_value).replace(" ", "")


CONFIGS = {  # (script, preset) -> its hydra config; None: the recipe has none
    ("train_verifier.sh", "small"): "verifier/small.yaml",
    ("train_verifier.sh", "base"): "verifier/base.yaml",
    ("train_drafter.sh", "small"): "drafter/small.yaml",
    ("train_drafter.sh", "base"): "drafter/base.yaml",
    ("train_drafter.sh", "cached_small"): "drafter/cached_small.yaml",
    ("train_drafter.sh", "cached_base"): None,
    ("train_feature_drafter.sh", "small"): "drafter/feature_small.yaml",
}
# YAML keys that are the command's arguments or a section's name, not a flag of the recipe
NOT_FLAGS = {"data", "save_dir", "_name"}


def test_every_recipe_is_listed():
    presets = {
        (script, preset)
        for script in ("train_verifier.sh", "train_drafter.sh", "train_feature_drafter.sh")
        for preset in re.findall(r"^\s*(\w+)\)\s+MODEL=", (REPO / "scripts" / script).read_text(),
                                 re.M)  # fmt: skip
    }
    assert presets == set(CONFIGS)


@pytest.mark.parametrize("script, preset", [key for key, config in CONFIGS.items() if config])
def test_hydra_config_equals_the_shell_recipe(script, preset):
    config = CONFIGS[script, preset]
    settings = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / config))
    flags = recipe_flags(script, preset)
    differ = {
        flag: (value, yaml_value(settings, flag))
        for flag, value in flags.items()
        if not same(value, yaml_value(settings, flag))
    }
    assert not differ, f"{config} differs from {script} {preset} (recipe, config): {differ}"
    only_in_config = [
        f"{section}.{key}"
        for section, values in settings.items()
        for key in values
        if key not in NOT_FLAGS and "--" + key.replace("_", "-") not in flags
    ]
    assert not only_in_config, f"{config} sets what {script} {preset} does not: {only_in_config}"
