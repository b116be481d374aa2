"""Configuration, at the bottom of the package: the names of every plug-in (`choices`), which options
combine (`rules`), the user's errors (`errors`), the dataclass sections and the world checks
(`sections`), YAML I/O and `--set` (`yaml_io`), fault specs (`fault_specs`) and help text (`help`)."""

from paraloom.config.sections import (
    CommConfig,
    Config,
    DataConfig,
    GuardConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PSConfig,
    RunConfig,
    SparseConfig,
    dump_config,
    load_config,
)

__all__ = ["CommConfig", "Config", "DataConfig", "GuardConfig", "ModelConfig", "OptimConfig", "PSConfig",
           "ParallelConfig", "RunConfig", "SparseConfig", "dump_config", "load_config"]
