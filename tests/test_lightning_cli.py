"""LightningCLI builds MPTPrecision and its scaler from a YAML config, and its help lists the plugin's arguments."""

import lightning as L
import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from models import TinyMLP, regression_data

from lightning_mpt import DynamicLossScaler, MPTPrecision


class Data(L.LightningDataModule):
    def train_dataloader(self):
        return regression_data()


CONFIG = {
    "trainer": {
        "max_steps": 3,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "plugins": [
            {
                "class_path": "lightning_mpt.MPTPrecision",
                "init_args": {
                    "precision": "fp16",
                    "max_consecutive_skips": 7,
                    "scaler": {
                        "class_path": "lightning_mpt.DynamicLossScaler",
                        "init_args": {"init_scale": 1024, "growth_interval": 100},
                    },
                },
            }
        ],
    }
}


def test_yaml_config_builds_the_plugin_and_trains(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    run_dir = tmp_path / "run"
    cli = LightningCLI(TinyMLP, Data, args=["fit", "--config", str(path), f"--trainer.default_root_dir={run_dir}"])
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, MPTPrecision)
    assert isinstance(plugin.scaler, DynamicLossScaler)
    assert plugin.scaler.growth_interval == 100
    assert plugin.max_consecutive_skips == 7
    assert plugin.history[0].scale == 1024.0
    assert cli.trainer.global_step == 3
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())  # the config LightningCLI saved round-trips
    assert saved["trainer"]["plugins"][0]["init_args"]["scaler"]["init_args"]["init_scale"] == 1024


def test_static_scale_from_the_command_line(tmp_path):
    cli = LightningCLI(
        TinyMLP,
        Data,
        args=[
            "fit",
            "--trainer.max_steps=2",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.plugins=lightning_mpt.MPTPrecision",
            "--trainer.plugins.precision=fp16",
            "--trainer.plugins.scaler=512.0",
            f"--trainer.default_root_dir={tmp_path}",
        ],
    )
    plugin = cli.trainer.precision_plugin
    assert plugin.scaler.is_static
    assert plugin.loss_scale == 512.0


def test_help_shows_the_plugin_arguments(capsys):
    with pytest.raises(SystemExit):
        LightningCLI(TinyMLP, Data, args=["fit", "--trainer.plugins.help", "lightning_mpt.MPTPrecision"])
    out = capsys.readouterr().out
    for arg in [
        "precision {fp16,bf16}",
        "--trainer.plugins.scaler",
        "master_weights",
        "keep_fp32",
        "max_consecutive_skips",
    ]:
        assert arg in out
    with pytest.raises(SystemExit):
        LightningCLI(
            TinyMLP,
            Data,
            args=[
                "fit",
                "--trainer.plugins=lightning_mpt.MPTPrecision",
                "--trainer.plugins.scaler.help",
                "DynamicLossScaler",
            ],
        )
    out = capsys.readouterr().out
    for arg in [
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "hysteresis",
        "min_scale",
        "max_scale",
    ]:
        assert arg in out
