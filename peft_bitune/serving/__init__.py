"""`bitune-serve`: an OpenAI-compatible chat server for Bitune adapters that keeps each conversation's mixed cache.

The HTTP side (`app.py`, `server.py`, `cli.py`) needs the `serve` extra (`pip install 'peft-bitune[serve]'`: FastAPI,
uvicorn, openai); `ChatEngine` and the kept conversations (`engine.py`, `conversations.py`) do not import them.
"""

from .conversations import ConversationStore, KeptConversation
from .engine import ChatEngine, ChatRequest, ChatResult

__all__ = ["ChatEngine", "ChatRequest", "ChatResult", "ConversationStore", "KeptConversation"]
