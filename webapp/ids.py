"""Every component id of the page, in one place: the layout builds components with these
names and the callbacks listen to them, so a renamed id is one edit and a typo an
error when the module loads instead of a callback that never fires."""

from __future__ import annotations

# The run strips' ids (Run, Cancel, progress, live picture, busy flag, downloads, message)
# are their
# component's, one per panel: webapp.run_strip.IMAGE_STRIP and VOLUME_STRIP.

# Stores: what the page keeps between callbacks
SESSION = "session"
IMAGE_STORE = "image-store"
REGION_STORE = "region-store"
PREDICTION_STORE = "prediction-store"
IMAGE_SHOWN = "image-shown"  # the image and model the picture on the page shows
# the image the user asked for last (set in the browser at the click) and the request the
# server answered last: while they differ, nothing beside the picture is shown
IMAGE_WANTED = "image-wanted"
IMAGE_ANSWERED = "image-answered"
RESULT_STORE = "result-store"
OVERLAY_STORE = "overlay-store"
UPLOAD_TICKET = "upload-ticket"
MODEL_UPLOAD_TICKET = "model-upload-ticket"

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
COMPARE = "compare"  # also compute Grad-CAM and Integrated Gradients
COMPARE_LAYER = "compare-layer"  # the layer Grad-CAM reads (None: the default rule)

# Run panel

# Result panel
RESULT_PANEL_BODY = "result-panel-body"
HEATMAP_GRAPH = "heatmap-graph"
RESULT_SUMMARY = "result-summary"
COMPARE_PANEL = "compare-panel"  # the three methods side by side
COMPARE_PENDING = "compare-pending"  # a sample's Compare button: run once it is shown
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

# Pattern-matching ids: {"type": SAMPLE, "name": ...}; the downloads' are the run strips'
# ({"type": IMAGE_STRIP.export, "format": ...})
SAMPLE = "sample"
COMPARE_SAMPLE = "compare-sample"  # {"type": COMPARE_SAMPLE, "name": ...}

# Inside callback answers (the settings and result panels build these)
OOD_WARNING = "ood-warning"
REUSE_INFO = "reuse-info"

# Volume panel (CT, MR): three linked views, a 3-D region, its own run and exports
VOLUME_UPLOAD = "volume-upload"
VOLUME_TICKET = "volume-ticket"
VOLUME_STORE = "volume-store"
VOLUME_WANTED = "volume-wanted"  # as IMAGE_WANTED and IMAGE_ANSWERED, for the volume panel
VOLUME_ANSWERED = "volume-answered"
VOLUME_REGION = "volume-region"
VOLUME_RESULT = "volume-result"
VOLUME_MODEL = "volume-model"
VOLUME_MODE = "volume-mode"
VOLUME_PATCH = "volume-patch"
VOLUME_STRIDE = "volume-stride"
VOLUME_LABEL = "volume-label"
VOLUME_WINDOW = "volume-window"
VOLUME_INFO = "volume-info"
VOLUME_REGION_TEXT = "volume-region-text"
VOLUME_RESET_REGION = "volume-reset-region"
VOLUME_SUMMARY = "volume-summary"
# one graph and one slider per view
VOLUME_GRAPH_AXIAL = "volume-graph-axial"
VOLUME_GRAPH_CORONAL = "volume-graph-coronal"
VOLUME_GRAPH_SAGITTAL = "volume-graph-sagittal"
VOLUME_SLIDER_AXIAL = "volume-slider-axial"
VOLUME_SLIDER_CORONAL = "volume-slider-coronal"
VOLUME_SLIDER_SAGITTAL = "volume-slider-sagittal"
VOLUME_COMPARE = "volume-compare"
VOLUME_COMPARE_LAYER = "volume-compare-layer"
VOLUME_SAMPLE = "volume-sample"  # {"type": VOLUME_SAMPLE, "name": ...}
VOLUME_COMPARE_SAMPLE = "volume-compare-sample"  # ... and its Compare button
VOLUME_COMPARE_PENDING = "volume-compare-pending"  # that volume: run once it is shown
VOLUME_COMPARE_PANEL = "volume-compare-panel"  # a row of three views per method
# The operator's PACS (only when one is configured): search, a study's series, open one
# (the server names it in VOLUME_TICKET, so it loads as an upload does), send a result
PACS_PATIENT = "pacs-patient"
PACS_DATES = "pacs-dates"
PACS_MODALITY = "pacs-modality"
PACS_ACCESSION = "pacs-accession"
PACS_SEARCH = "pacs-search"
PACS_STUDY = "pacs-study"
PACS_SERIES = "pacs-series"
PACS_OPEN = "pacs-open"
PACS_IMAGE_NUMBER = "pacs-image-number"
PACS_OPEN_IMAGE = "pacs-open-image"
PACS_MESSAGE = "pacs-message"
PACS_SEND = "pacs-send"
PACS_SENT = "pacs-sent"
PACS_IMAGE_SEND = "pacs-image-send"
PACS_IMAGE_SENT = "pacs-image-sent"

# view -> its graph and its slider
VOLUME_GRAPHS = (
    ("axial", VOLUME_GRAPH_AXIAL, VOLUME_SLIDER_AXIAL),
    ("coronal", VOLUME_GRAPH_CORONAL, VOLUME_SLIDER_CORONAL),
    ("sagittal", VOLUME_GRAPH_SAGITTAL, VOLUME_SLIDER_SAGITTAL),
)
MODEL_UPLOAD_DETAILS = "model-upload-details"  # "Add your own model"
