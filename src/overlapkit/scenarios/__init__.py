"""Scenario files: YAML -> typed config objects, validation, ``--set`` overrides."""

from .config import Scenario
from .loader import Problem, ScenarioError, dump_scenario, load_scenario, parse_yaml

__all__ = ["Problem", "Scenario", "ScenarioError", "dump_scenario", "load_scenario", "parse_yaml"]
