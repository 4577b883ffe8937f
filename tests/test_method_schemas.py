"""The methods' and models' typed config schemas (qtrain.config.methods, qtrain.config.models): one per conf/method
and conf/model file, of its keys, checked before any work and without torch."""

import dataclasses
import subprocess
import sys
import typing

import pytest
from omegaconf import DictConfig, OmegaConf

from qtrain import catalog
from qtrain.config import group_options, validate
from qtrain.config import methods as schemas
from qtrain.config import models as model_schemas
from qtrain.config.methods import check_method
from qtrain.config.models import check_model
from qtrain.errors import ConfigError
from qtrain.resources import conf_dir

from .conftest import make_config, run_cli


def _schema_keys(schema: type, node: DictConfig, where: str) -> None:
    """``schema``'s fields are ``node``'s keys, and so on down every nested schema whose key holds a mapping."""
    assert {item.name for item in dataclasses.fields(schema)} == set(node.keys()), where
    kinds = typing.get_type_hints(schema)
    for key in node.keys():
        nested = [k for k in (kinds[key], *typing.get_args(kinds[key])) if dataclasses.is_dataclass(k)]
        if nested and isinstance(node._get_node(key), DictConfig):
            _schema_keys(nested[0], node[key], f"{where}.{key}")


@pytest.mark.parametrize("path", sorted((conf_dir() / "method").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_method_file_has_a_schema_of_exactly_its_keys(path):
    _schema_keys(schemas.METHODS[path.stem], OmegaConf.load(path), path.stem)


def test_the_registry_holds_a_schema_for_every_method_file():
    files = sorted(p.stem for p in (conf_dir() / "method").glob("*.yaml"))
    assert sorted(schemas.METHODS) == files


@pytest.mark.parametrize("name", catalog.METHOD_NAMES)
def test_every_registered_method_is_built_with_its_typed_config(name):
    """The registry's one entry per method gives the class that trains it, handed the schema's checked object."""
    from qtrain.methods import Method, build_method

    built = build_method(make_config(f"method={name}").method)
    assert isinstance(built, Method) and built.name == name
    assert type(built.cfg) is schemas.METHODS[name] and not isinstance(built.cfg, DictConfig)
    assert type(built).__module__ == f"qtrain.methods.{name}"


def test_a_choice_is_its_text():
    """A config choice is an Enum member that equals, hashes, prints and formats as the YAML's text."""
    tensor = schemas.ActRange("tensor")
    assert tensor is schemas.ActRange.TENSOR and tensor == "tensor" and tensor != "sample_mean"
    assert {"tensor": 1}[tensor] == 1 and str(tensor) == f"{tensor}" == f"{tensor:>6}".strip() == "tensor"
    built = check_method(make_config("method=mx", "method.weight=nvfp4", "method.weight_blocks=2d").method)
    assert built.weight is schemas.BlockFormat.NVFP4 and built.weight_blocks is schemas.WeightBlocks.TWO_D


@pytest.mark.parametrize("method", catalog.METHOD_NAMES)
@pytest.mark.slow
def test_every_method_default_fits_its_schema_with_every_model_it_gates(method):
    models = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))
    for model in models:
        cfg = make_config(f"method={method}", f"model={model}")
        if method in catalog.GATED and cfg.model.get("dfq_options") is None:
            with pytest.raises(ConfigError, match=f"^method {method} needs a model with residual blocks to gate"):
                check_method(cfg.method)
        else:
            assert check_method(cfg.method).name == method


def test_interpolated_values_are_checked_as_resolved():
    assert check_method(make_config("method=sbm", "method.grad_bits=16").method).grad_weight_bits == 16
    assert check_method(make_config("method=dfq", "model=resnet18").method).weight_bits == 6  # the model config's
    with pytest.raises(ConfigError, match=r"^method.weight_bits=40 is not allowed: bit-widths are integers from 1 to 32"):
        check_method(make_config("method=dfq", "model=resnet18", "model.dfq_weight_bits=40").method)


def test_validate_refuses_a_bad_method_value():
    with pytest.raises(ConfigError, match=r"^method.execution='sometimes' is not allowed \(choose from: per_sample, "):
        validate(make_config("method=dfq", "method.execution=sometimes"))


@pytest.mark.parametrize("overrides,message", [
    (["method=adapt", "method.lookback.high=10"],
     "method.lookback.high=10 is not allowed: it must be an integer >= method.lookback.low (25)"),
    (["model=transformer", "data=text", "model.heads=3"],  # the sizes come from the presets' resolver
     "model.d_model=128 is not allowed with model.heads=3: d_model must be even and a multiple of heads"),
], ids=["method", "transformer"])
def test_a_bad_value_is_refused_without_importing_torch(overrides, message):
    code = ("import sys\n"
            "from qtrain.config import validate\n"
            "from qtrain.config.command_line import compose_config\n"
            "from qtrain.errors import ConfigError\n"
            "from qtrain.resources import conf_dir\n"
            "try:\n"
            f"    validate(compose_config(conf_dir(), {overrides!r}))\n"
            "except ConfigError as error:\n"
            "    print(error)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stderr == ""
    assert result.stdout == message + "\n"


def test_a_bad_method_value_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    result = run_cli("method=muppet", "method.schedule=[8,32,16]", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["qtrain: error: method.schedule=[8, 32, 16] is not allowed: strictly increasing "
                                          "word lengths from 2 to 32, at least one (32, float32, can only be the last)"]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("path", sorted((conf_dir() / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_model_file_has_a_schema_of_its_own_keys(path):
    node = OmegaConf.load(path)
    node = node.model if "model" in node else node  # the transformer's file also sets the training recipe
    own = {key for key in node.keys() if not key.startswith("dfq_")}  # the gated methods' keys: their schemas'
    schema = model_schemas.MODELS.get(path.stem, model_schemas.ModelConfig)
    assert {item.name for item in dataclasses.fields(schema)} == own


def test_the_model_schemas_are_of_models_qtrain_has():
    from qtrain.models import MODELS

    files = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))
    assert files == sorted(MODELS)
    assert set(model_schemas.MODELS) < set(files)


def test_validate_refuses_an_unknown_model_naming_the_conf_files():
    with pytest.raises(ConfigError) as error:
        validate(make_config("model.name=vgg"))
    assert str(error.value) == f"unknown model 'vgg' (choose from: {', '.join(group_options(conf_dir(), 'model'))})"


def test_validate_refuses_a_bad_model_value():
    with pytest.raises(ConfigError, match=r"^model.stem='big' is not allowed \(choose from: auto, cifar, imagenet\)$"):
        validate(make_config("model=resnet18", "model.stem=big"))
    with pytest.raises(ConfigError, match=r"^model.classifier_init='xavier' is not allowed \(choose from: torch, "
                                          r"normal_in_out\)$"):
        validate(make_config("model=resnet38", "model.classifier_init=xavier"))
    with pytest.raises(ConfigError, match=r"^model.d_model=32 is not allowed with model.heads=5: "):
        check_model(make_config("model=transformer", "model.preset=tiny", "model.heads=5").model)


@pytest.mark.parametrize("method,override,message", [
    ("dfq", "model.dfq_gate.width=0", "method.gate.width=0 is not allowed: it must be an integer >= 1 or null"),
    ("muppet", "method.performance_model.same.epochs=0",
     "method.performance_model.same.epochs=0 is not allowed: it must be a finite number > 0 or null"),
    ("fractrain", "method.cp_total=101", "method.cp_total=101 is not allowed: it must be a finite number in (0, 100] or null"),
])
def test_a_key_that_may_be_null_says_so(method, override, message):
    with pytest.raises(ConfigError) as error:
        check_method(make_config(f"method={method}", override).method)
    assert str(error.value) == message
