"""`bitune-serve`: an OpenAI-compatible chat server for Bitune adapters that keeps each conversation's mixed cache.

Needs the `serve` extra (`pip install 'peft-bitune[serve]'`: FastAPI, uvicorn, openai). `ChatEngine` and the kept
conversations (`engine.py`, `conversations.py`) need only torch and transformers; `build_app` (`app.py`) the extra.
"""

from .conversations import ConversationStore, KeptConversation
from .engine import ChatEngine, ChatRequest, ChatResult

__all__ = ["ChatEngine", "ChatRequest", "ChatResult", "ConversationStore", "KeptConversation"]
