/* Krypton: files go to the server on their own route, not inside a callback's JSON body
   (webapp/uploads.py says why). A clientside callback hands the dcc.Upload's file to
   `send`, which posts its bytes and returns the server's ticket (a token, or an error
   the page shows) for the Dash callback that uses the file.

   A file over the limit never reaches `send`: dcc.Upload's max_size drops it without a
   word (the browser does not even read it). `refuseOversized` sees the same file first,
   on the drop or the file picker's change, and gives the upload's ticket an error that
   says the file's size and the limit, so the page says why nothing happened. */
window.dash_clientside = Object.assign({}, window.dash_clientside, {
    krypton_upload: {
        send: async function (contents, filename, session, purpose) {
            if (!contents) {
                return window.dash_clientside.no_update;
            }
            const ticket = {name: filename || "", sent: Date.now()};
            try {
                const blob = await (await fetch(contents)).blob();
                // Session and file name travel in headers: URLs are logged, and a DICOM
                // file's name often names the patient.
                const response = await fetch("_krypton/upload/" + purpose, {
                    method: "POST",
                    body: blob,
                    credentials: "same-origin",
                    headers: {
                        "Content-Type": "application/octet-stream",
                        "X-Krypton-Session": session || "",
                        "X-Krypton-Filename": encodeURIComponent(filename || ""),
                    },
                });
                const text = await response.text();
                let answer;
                try {
                    answer = JSON.parse(text);
                } catch (error) {
                    answer = {error: text || ("the upload failed (HTTP " + response.status + ")")};
                }
                return Object.assign(ticket, answer);
            } catch (error) {
                return Object.assign(ticket, {error: "the upload failed (" + error + ")"});
            }
        },
        image: function (contents, filename, session) {
            return window.dash_clientside.krypton_upload.send(contents, filename, session, "image");
        },
        model: function (contents, filename, session) {
            return window.dash_clientside.krypton_upload.send(contents, filename, session, "model");
        },
        volume: function (contents, filename, session) {
            return window.dash_clientside.krypton_upload.send(contents, filename, session, "volume");
        },
    },
});

(function () {
    // the server's wording (webapp/uploads.py): the size to 0.1 MB, the limit as set
    function megabytes(bytes) {
        return (bytes / 2 ** 20).toFixed(1);
    }
    function limitMegabytes(bytes) {
        return String(Number((bytes / 2 ** 20).toPrecision(4)));
    }
    function refuseOversized(event) {
        const zone = event.target && event.target.closest
            ? event.target.closest("[data-max-bytes]") : null;
        if (!zone || !window.dash_clientside.set_props) {
            return;
        }
        const files = event.type === "drop"
            ? (event.dataTransfer && event.dataTransfer.files) : event.target.files;
        if (!files || !files.length) {
            return;
        }
        const file = files[0];
        const limit = Number(zone.dataset.maxBytes);
        if (file.size > limit) {
            window.dash_clientside.set_props(zone.dataset.ticket, {data: {
                name: file.name,
                sent: Date.now(),
                error: file.name + " is " + megabytes(file.size) + " MB; the limit is "
                    + limitMegabytes(limit) + " MB",
            }});
        }
    }
    document.addEventListener("change", refuseOversized, true);
    document.addEventListener("drop", refuseOversized, true);
})();
