"""Config checks that run before any work, without torch, and a run's identity: the command line
(:mod:`~qtrain.config.command_line`), the composed config against the typed schemas of its groups, method and model
(:mod:`~qtrain.config.checks`, :mod:`~qtrain.config.schema`, :mod:`~qtrain.config.methods`,
:mod:`~qtrain.config.models`), the identity and its digest (:mod:`~qtrain.config.identity`) and the resolvers
(:mod:`~qtrain.config.resolvers`). docs/running.md says what a user sees of them."""

from qtrain.config.checks import validate
from qtrain.config.command_line import GROUPS, check_command_line, group_options, sweep_size, swept_keys
from qtrain.config.identity import (
                                   NOT_CONFIGURATION,
                                   NOT_IDENTITY,
                                   NOT_IN_DIR_NAME,
                                   OMITTED_AT,
                                   RUN_KEYS,
                                   digest,
                                   first_difference,
                                   identity,
                                   recorded,
                                   with_keys_added_since,
)
from qtrain.config.resolvers import NAME_LENGTH, run_dir_name

__all__ = ["GROUPS", "NAME_LENGTH", "NOT_CONFIGURATION", "NOT_IDENTITY", "NOT_IN_DIR_NAME", "OMITTED_AT",
           "RUN_KEYS",
           "check_command_line", "digest", "first_difference", "group_options", "identity", "recorded", "run_dir_name",
           "sweep_size", "swept_keys", "validate", "with_keys_added_since"]
