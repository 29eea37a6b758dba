"""Every component id of the page, in one place: the layout builds components with these
names and the callbacks listen to them, so a renamed id is one edit and a typo an
error when the module loads instead of a callback that never fires."""

from __future__ import annotations

# Stores: what the page keeps between callbacks
SESSION = "session"
IMAGE_STORE = "image-store"
REGION_STORE = "region-store"
PREDICTION_STORE = "prediction-store"
RESULT_STORE = "result-store"
OVERLAY_STORE = "overlay-store"
UPLOAD_TICKET = "upload-ticket"
MODEL_UPLOAD_TICKET = "model-upload-ticket"
DOWNLOAD = "download"

# Image panel
UPLOAD = "upload"
IMAGE_GRAPH = "image-graph"
REGION_TEXT = "region-text"
RESET_REGION = "reset-region"
DICOM_PANEL = "dicom-panel"
DICOM_INFO = "dicom-info"
FRAME_PICKER = "frame-picker"
DICOM_FRAME = "dicom-frame"
WINDOW_PRESET = "window-preset"
MANUAL_WINDOW = "manual-window"
WINDOW_CENTRE = "window-centre"
WINDOW_WIDTH = "window-width"

# Settings panel
MODEL = "model"
MODEL_CARD = "model-card"
TOP5 = "top5"
LABEL = "label"
PATCH = "patch"
STRIDE = "stride"
MODE = "mode"
COLOUR = "colour"
CUSTOM_COLOUR = "custom-colour"
APPROXIMATE_SETTINGS = "approximate-settings"
TARGET_SSIM = "target-ssim"
DRILL_DOWN = "drill-down"
TARGET_SPEEDUP = "target-speedup"
SNAP = "snap"
ESTIMATE = "estimate"

# Run panel
RUN = "run"
CANCEL = "cancel"
MESSAGE = "message"
PROGRESS = "progress"
LIVE_PANEL = "live-panel"
LIVE_GRAPH = "live-graph"
LIVE_STATUS = "live-status"

# Result panel
RESULT_PANEL_BODY = "result-panel-body"
HEATMAP_GRAPH = "heatmap-graph"
RESULT_SUMMARY = "result-summary"
DICOM_IDENTITY = "dicom-identity"
OVERLAY_SHOW = "overlay-show"
OVERLAY_VIEW = "overlay-view"
OVERLAY_SCALE = "overlay-scale"
OVERLAY_OPACITY = "overlay-opacity"
OVERLAY_THRESHOLD = "overlay-threshold"

# Models panel (add your own model)
MODEL_UPLOAD = "model-upload"
MODEL_UPLOAD_NAME = "model-upload-name"
MODEL_NAME = "model-name"
MODEL_ARCHITECTURE = "model-architecture"
MODEL_CLASSES = "model-classes"
MODEL_SIZE = "model-size"
MODEL_REGISTER = "model-register"
MODEL_REGISTER_MESSAGE = "model-register-message"
MODEL_REMOVE = "model-remove"

# Pattern-matching ids: {"type": SAMPLE, "name": ...} and {"type": EXPORT, "format": ...}
SAMPLE = "sample"
EXPORT = "export"

# Inside callback answers (the settings and result panels build these)
OOD_WARNING = "ood-warning"
REUSE_INFO = "reuse-info"
