"""The forward switches, read from the environment once per load (``read_switches``) and handed down:
no kernel reads the environment."""

from __future__ import annotations

from dataclasses import dataclass

from ..util.paths import env_on, env_text


@dataclass(frozen=True)
class Switches:
    """The environment's forward switches as read at one load (``read_switches``)."""

    lean: bool = True            # RAKV_LEAN: the lean forward where the architecture allows (else HF's)
    c_layers: bool = True        # RAKV_C_LAYERS: a step's layers in one C call where the model allows
    blockq: bool = True          # RAKV_BLOCKQ: the block kernel (codes, its attention)
    tiles: bool = True           # RAKV_TILES: q8 codes in the tiled form (0: the lane form, for comparisons)
    one_row: str = "auto"        # RAKV_ONE_ROW: plain | packed forces the fp32 one-row kernel

    def as_dict(self) -> dict:
        return {"lean": self.lean, "c_layers": self.c_layers, "blockq": self.blockq, "tiles": self.tiles,
                "one_row": self.one_row}


def read_switches() -> Switches:
    """The forward switches from the environment, now (called once per load)."""
    one_row = env_text("RAKV_ONE_ROW", "auto").strip().lower()
    return Switches(lean=env_on("RAKV_LEAN"), c_layers=env_on("RAKV_C_LAYERS"), blockq=env_on("RAKV_BLOCKQ"),
                    tiles=env_text("RAKV_TILES", "1") != "0",
                    one_row=one_row if one_row in ("plain", "packed") else "auto")
