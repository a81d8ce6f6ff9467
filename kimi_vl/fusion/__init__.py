"""Early fusion: media become tokens of the one shared sequence.

- `placeholders`: how many placeholder tokens stand for an image or a video (and the timestamped blocks of video
  chunks); the processor expands the text with it.
- `embedding`: media through the vision tower and the projector (`media_tokens`), written over their placeholders
  (`scatter_media`, `fuse_media`); the model embeds its inputs with it.
"""

from .embedding import fuse_media, media_tokens, scatter_media
from .placeholders import format_timestamp, frame_times, image_placeholders, video_placeholders

__all__ = ["format_timestamp", "frame_times", "fuse_media", "image_placeholders", "media_tokens", "scatter_media",
           "video_placeholders"]
