/* Krypton: files go to the server on their own route, not inside a callback's JSON body
   (webapp/uploads.py says why). A clientside callback hands the dcc.Upload's file to
   `send`, which posts its bytes and returns the server's ticket (a token, or an error
   the page shows) for the Dash callback that uses the file. */
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
    },
});
