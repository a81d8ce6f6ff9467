"""MoonViT-3D: the native-resolution vision encoder, its multimodal projector, the image/video processors and
safe media I/O."""

from kimi_vl.vision.configuration import MoonViTConfig
from kimi_vl.vision.image_processing import MoonViTImageProcessor
from kimi_vl.vision.media import VideoFrames, load_image, load_video
from kimi_vl.vision.moonvit import MoonViTModel
from kimi_vl.vision.projector import MoonViTProjector
from kimi_vl.vision.video_processing import MoonViTVideoProcessor

__all__ = [
    "MoonViTConfig",
    "MoonViTImageProcessor",
    "MoonViTModel",
    "MoonViTProjector",
    "MoonViTVideoProcessor",
    "VideoFrames",
    "load_image",
    "load_video",
]
