"""Image and video decoding with limits and one clear error type (MediaError)."""

from mmspec_ray.media.errors import MediaError
from mmspec_ray.media.image import load_image
from mmspec_ray.media.video import VideoClip, load_video

__all__ = ["MediaError", "VideoClip", "load_image", "load_video"]
