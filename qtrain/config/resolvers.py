"""The resolvers qtrain's config files use (``qtrain.transformer``, ``qtrain.not_in_dir_name``), registered on import,
and the run directory's name (``qtrain.run_dir_name``, registered by the ``qtrain`` command)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from qtrain.config.identity import NOT_IN_DIR_NAME, digest, identity
from qtrain.config.models import preset_value

# The longest part of a run directory's name taken from its overrides (whole key=value items; the id follows).
NAME_LENGTH = 120


OmegaConf.register_new_resolver("qtrain.transformer", preset_value, replace=True)
# hydra.job.config.override_dirname.exclude_keys of conf/config.yaml
OmegaConf.register_new_resolver("qtrain.not_in_dir_name", lambda: list(NOT_IN_DIR_NAME), replace=True)


def run_dir_name(override_dirname: str, *, _root_: DictConfig) -> str:
    """The last part of a run directory: the overrides that name it, then ``id=`` the identity's digest.

    Registered as the resolver ``qtrain.run_dir_name`` and used by ``hydra.run.dir`` and
    ``hydra.sweep.subdir``: two configs with different identities never share a directory. The overrides
    are kept whole, as many as fit in :data:`NAME_LENGTH` characters. One identity may get two names
    (``seed=0`` given or left to its default): a run reuses a finished run of the same identity
    from a directory beside this one (:func:`qtrain.run_state.finished_twin`).
    """
    task = OmegaConf.masked_copy(_root_, [k for k in _root_.keys() if k != "hydra"])
    name = ""
    for item in override_dirname.replace("/", "_").split(","):  # whole key=value items only, up to NAME_LENGTH
        longer = f"{name},{item}" if name else item
        if len(longer) > NAME_LENGTH:
            break
        name = longer
    run_id = f"id={digest(identity(task))}"
    return f"{name},{run_id}" if name else run_id
