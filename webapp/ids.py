"""Every component id of the page, in one place: the layout builds components with these
names and the callbacks listen to them, so a renamed id is one edit and a typo an
error when the module loads instead of a callback that never fires."""

from __future__ import annotations

# What both the image and the volume panel have (the subject's upload and stores, its
# region, the run's settings, Compare, the summary, and the run strip: Run, Cancel,
# progress, live picture, downloads, message) is one component with a scope, one instance
# per panel: webapp.panel_scope.IMAGE_PANEL and VOLUME_PANEL. Here: what one panel alone has.

# Stores: what the page keeps between callbacks
SESSION = "session"
PREDICTION_STORE = "prediction-store"
IMAGE_SHOWN = "image-shown"  # the image and model the picture on the page shows
OVERLAY_STORE = "overlay-store"
MODEL_UPLOAD_TICKET = "model-upload-ticket"

# Image panel
IMAGE_GRAPH = "image-graph"
DICOM_PANEL = "dicom-panel"
DICOM_INFO = "dicom-info"
FRAME_PICKER = "frame-picker"
DICOM_FRAME = "dicom-frame"
WINDOW_PRESET = "window-preset"
MANUAL_WINDOW = "manual-window"
WINDOW_CENTRE = "window-centre"
WINDOW_WIDTH = "window-width"

# Settings panel
MODEL_CARD = "model-card"
TOP5 = "top5"
COLOUR = "colour"
CUSTOM_COLOUR = "custom-colour"
APPROXIMATE_SETTINGS = "approximate-settings"
TARGET_SSIM = "target-ssim"
DRILL_DOWN = "drill-down"
TARGET_SPEEDUP = "target-speedup"
SNAP = "snap"

# Result panel
RESULT_PANEL_BODY = "result-panel-body"
HEATMAP_GRAPH = "heatmap-graph"
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

# Inside callback answers (the settings panel builds it)
OOD_WARNING = "ood-warning"

# Volume panel (CT, MR): three linked views with a slider each, the display window
VOLUME_WINDOW = "volume-window"
VOLUME_INFO = "volume-info"
# one graph and one slider per view
VOLUME_GRAPH_AXIAL = "volume-graph-axial"
VOLUME_GRAPH_CORONAL = "volume-graph-coronal"
VOLUME_GRAPH_SAGITTAL = "volume-graph-sagittal"
VOLUME_SLIDER_AXIAL = "volume-slider-axial"
VOLUME_SLIDER_CORONAL = "volume-slider-coronal"
VOLUME_SLIDER_SAGITTAL = "volume-slider-sagittal"
# The operator's PACS (only when one is configured): search, a study's series, open one
# (the server names it in the volume panel's ticket, so it loads as an upload does), send a result
PACS_PATIENT = "pacs-patient"
PACS_DATES = "pacs-dates"
PACS_MODALITY = "pacs-modality"
PACS_ACCESSION = "pacs-accession"
PACS_SEARCH = "pacs-search"
PACS_STUDY = "pacs-study"
PACS_SERIES = "pacs-series"
PACS_IMAGE_NUMBER = "pacs-image-number"
PACS_MESSAGE = "pacs-message"

# view -> its graph and its slider
VOLUME_GRAPHS = (
    ("axial", VOLUME_GRAPH_AXIAL, VOLUME_SLIDER_AXIAL),
    ("coronal", VOLUME_GRAPH_CORONAL, VOLUME_SLIDER_CORONAL),
    ("sagittal", VOLUME_GRAPH_SAGITTAL, VOLUME_SLIDER_SAGITTAL),
)
MODEL_UPLOAD_DETAILS = "model-upload-details"  # "Add your own model"
