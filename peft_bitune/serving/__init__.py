"""`bitune-serve`: an OpenAI-compatible chat server for Bitune adapters that keeps each conversation's mixed cache.

- `prompts.py`: a request's conversation laid out as the adapter was trained to read it (turns from the chat template);
- `conversations.py`: the kept conversations, and how much of one a request may reuse without changing its answer;
- `engine.py`: reads a request (reusing what it may), generates, keeps the result; `worker.py`: its one model thread;
  `batching.py`: the requests waiting for it answered in one `generate`, each row's cache kept on its own;
- `streaming.py`: incremental text, stop strings, clients that leave;
- `settings.py`: how the server guards itself (API keys, origins, the largest body), and how large its batches are;
- `validation.py`, `app.py`, `server.py`, `cli.py`: the HTTP side, which needs the `serve` extra (`pip install
  'peft-bitune[serve]'`: FastAPI, uvicorn, openai, pydantic; jinja2 renders chat templates).
"""

from .conversations import ConversationStore, KeptConversation
from .engine import ChatEngine, ChatRequest, ChatResult

__all__ = ["ChatEngine", "ChatRequest", "ChatResult", "ConversationStore", "KeptConversation"]
