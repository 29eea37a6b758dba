/* Krypton: what sits beside a picture is decided at the click.

   A sample's button, a file or another model makes the page's prediction, class list,
   estimate and Run belong to a picture that is about to go. These rules hide them (and
   disable Run) in the browser at once. They listen to the user's inputs alone, so no
   server callback in flight can hold them back; the panels' show rules bring them back
   once the data for the picture on screen has arrived and the request the server
   answered last (IMAGE_ANSWERED, VOLUME_ANSWERED) is the one wanted here.

   A request is named as webapp.panels.common.origin names it: "sample:NAME" or
   "upload:FILENAME". */
(function () {
    const HIDDEN = {"display": "none"};

    function wanted(filename, ticket) {
        const context = window.dash_clientside.callback_context;
        const trigger = context.triggered && context.triggered.length
            ? context.triggered[0] : null;
        if (!trigger || trigger.value === null || trigger.value === undefined) {
            return null;  // a button created, not clicked
        }
        const id = trigger.prop_id.slice(0, trigger.prop_id.lastIndexOf("."));
        if (id.startsWith("{")) {
            return "sample:" + JSON.parse(id).name;
        }
        if (id.endsWith("ticket")) {  // an upload's ticket, refused before it was sent too
            return "upload:" + ((ticket && ticket.name) || "");
        }
        if (id.endsWith("upload")) {
            return "upload:" + (filename || "");
        }
        return undefined;  // another model: the same picture, another prediction
    }

    function hiding(name) {
        const noUpdate = window.dash_clientside.no_update;
        const count = window.dash_clientside.callback_context.outputs_list.length;
        if (name === null) {
            return Array(count).fill(noUpdate);
        }
        return [name === undefined ? noUpdate : name, ...Array(count - 2).fill(HIDDEN), true];
    }

    window.dash_clientside = Object.assign({}, window.dash_clientside, {
        krypton_binding: {
            // At the click: what was wanted, then every other output hidden and Run
            // disabled (the last output), for either panel (webapp.panels.common.hide_at_click).
            hide: function (samples, compares, contents, model, filename) {
                return hiding(wanted(filename, null));
            },
            // The same for an upload's ticket alone (a file refused before it was sent):
            // a rule of its own, since Dash runs a callback only once every callback
            // feeding its inputs has answered, and the ticket comes from the upload's
            // POST (on a busy host, seconds after the click).
            hideForTicket: function (ticket) {
                return hiding(wanted(null, ticket));
            },
            // Run off while this panel's run is under way (webapp.panels.common.off_while_running);
            // the show rules below turn it on again.
            offWhileRunning: function (busy) {
                return busy ? true : window.dash_clientside.no_update;
            },
            // The volume panel's: the description, class box, estimate and summary once the
            // volume answered is the one wanted and the description is that volume's.
            showVolume: function (info, volume, busy, want, answered, estimate, summary) {
                const settled = (want || null) === (answered || null);
                const bound = settled && Boolean(volume) && typeof info === "string"
                    && info.startsWith(volume.name + ":");
                const visible = bound ? {} : HIDDEN;
                return [visible, visible, visible, visible, !(bound && !busy)];
            },
            // Either panel's result (webapp.panels.subject_panel): its summary, picture,
            // Compare view and downloads only beside the subject it explains (``shown``:
            // its key and model, from the server's show_result), once the request answered
            // is the one wanted and, for the image panel, the picture drawn (``onScreen``)
            // is that subject; else hidden, downloads off. No result (a placeholder, a reason) shows once
            // the request answered is the one wanted: a reason computed in between ("the
            // class changed", while a sample's Compare reloads it) flashed before.
            showResult: function (shown, subject, model, want, answered, onScreen) {
                const outputs = window.dash_clientside.callback_context.outputs_list;
                const off = outputs[2].map(() => true);
                const settled = (want || null) === (answered || null);
                if (!shown) {  // a reason, once the request answered is the one wanted
                    return settled ? [{}, {}, off] : [HIDDEN, HIDDEN, off];
                }
                const drawn = onScreen === undefined
                    ? Boolean(subject) && {key: subject.key, model: model} : onScreen;
                const bound = settled && Boolean(subject) && Boolean(drawn)
                    && shown.key === subject.key && shown.model === model
                    && shown.key === drawn.key && shown.model === drawn.model;
                return bound ? [{}, {}, shown.disabled] : [HIDDEN, HIDDEN, off];
            },
            // The image panel's show rule: the top 5 and class list only beside the picture
            // they are for, the estimate and Run only once nothing is pending.
            showImage: function (prediction, image, model, busy, shown, want, answered, estimate) {
                const settled = (want || null) === (answered || null);
                const on = p => Boolean(p) && Boolean(shown) && p.image === shown.key
                    && p.model === shown.model;
                const bound = settled && on(prediction);
                const visible = bound ? {} : HIDDEN;
                const current = bound && Boolean(image) && image.key === shown.key
                    && model === shown.model;
                return [visible, visible, current ? {} : HIDDEN, !(current && !busy)];
            },
        },
    });
})();
