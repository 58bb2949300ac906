"""Loading a model: a hub id or local folder (``hub``), a ``.gguf`` file converted once (``gguf``,
``slim``), the embedded ``demo`` (``demo``), a preset (``presets``); its tokenizer (``tokenizer``);
its arithmetic and forward path (``numerics``); the loaded model itself (``loaded``).

Imports point down: loaded < slim < gguf < demo < numerics < tokenizer < hub.
"""

from .hub import load_model
from .loaded import LoadedModel, ModelError
from .numerics import wrap

__all__ = ["LoadedModel", "ModelError", "load_model", "wrap"]
