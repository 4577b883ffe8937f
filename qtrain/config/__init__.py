"""Config checks that run before any work, and a run's identity.

Checks give one-line errors naming the bad value and what is allowed:

- :func:`check_command_line` reads the command line before Hydra composes anything: group choices
  (``method=...``) must name a file in ``conf/``; every ``key=value`` must name a key of the composed
  config (an unknown key gets the nearest valid one), and its value must have the type of the key's
  default; ``+key`` and ``~key`` are refused, since nothing in qtrain reads a key its config files lack;
  a key given twice is refused (Hydra would keep the last silently).
  ``hydra/launcher=...`` must name a launcher, and ``hydra.launcher.KEY=...`` one of its keys.
- :func:`validate` checks the run-level values of a composed config (training length, batch sizes,
  device, data, optimizer, schedule) and the model's and the method's values against their schemas
  (:mod:`qtrain.config.models`, :mod:`qtrain.config.methods`).

A run's identity (:func:`identity`) is its whole resolved config minus :data:`NOT_IDENTITY`, the keys
that cannot change its results, plus ``world_size`` where torchrun starts more than one process
(BatchNorm statistics and activation ranges are per process), and ``data.python``, the Python release,
for ``data=text`` (its corpus is that release's documentation); its digest names the run directory and
guards resumes (``run.py``), so a run never resumes under another world size.
"""

from qtrain.config.checks import validate
from qtrain.config.command_line import GROUPS, check_command_line, group_options, sweep_size, swept_keys
from qtrain.config.identity import NOT_CONFIGURATION, NOT_IDENTITY, NOT_IN_DIR_NAME, RUN_KEYS, digest, first_difference, identity
from qtrain.config.resolvers import NAME_LENGTH, run_dir_name

__all__ = ["GROUPS", "NAME_LENGTH", "NOT_CONFIGURATION", "NOT_IDENTITY", "NOT_IN_DIR_NAME", "RUN_KEYS",
           "check_command_line", "digest", "first_difference", "group_options", "identity", "run_dir_name", "sweep_size",
           "swept_keys", "validate"]
