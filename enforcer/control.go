package enforcer

import (
	"encoding/json"
	"errors"
	"net/http"

	"github.com/mgpu-dev/mgpu/enforcer/api"
)

// handler is the control API (docs/control-api.md).
func (e *Enforcer) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/device", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, e.Device())
	})
	mux.HandleFunc("GET /v1/instances", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, api.ListResponse{Instances: e.List()})
	})
	mux.HandleFunc("POST /v1/instances", func(w http.ResponseWriter, r *http.Request) {
		req, err := api.DecodeCreateRequest(http.MaxBytesReader(w, r.Body, api.MaxRequestBytes))
		if err != nil {
			writeError(w, err)
			return
		}
		out, err := e.Create(req)
		if err != nil {
			writeError(w, err)
			return
		}
		status := http.StatusCreated
		if out.Existing {
			status = http.StatusOK
		}
		writeJSON(w, status, out)
	})
	mux.HandleFunc("GET /v1/instances/{name}", func(w http.ResponseWriter, r *http.Request) {
		in, err := e.Get(r.PathValue("name"))
		if err != nil {
			writeError(w, err)
			return
		}
		writeJSON(w, http.StatusOK, in)
	})
	mux.HandleFunc("DELETE /v1/instances/{name}", func(w http.ResponseWriter, r *http.Request) {
		out, err := e.Destroy(r.PathValue("name"))
		if err != nil {
			writeError(w, err)
			return
		}
		writeJSON(w, http.StatusOK, out)
	})
	mux.HandleFunc("DELETE /v1/instances", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		if len(q) != 1 || len(q["container_id"]) != 1 {
			writeError(w, invalidf("DELETE /v1/instances needs exactly one query parameter, container_id"))
			return
		}
		out, err := e.DestroyContainer(q.Get("container_id"))
		if err != nil {
			writeError(w, err)
			return
		}
		writeJSON(w, http.StatusOK, out)
	})
	mux.HandleFunc("GET /v1/stats", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, api.StatsResponse{Instances: e.Stats()})
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusNotFound, api.ErrorResponse{Error: "no endpoint " + r.Method + " " + r.URL.Path + " (this enforcer speaks /" + api.Version + "/...)"})
	})
	return mux
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func writeError(w http.ResponseWriter, err error) {
	status := http.StatusInternalServerError
	var mbe *http.MaxBytesError
	switch {
	case errors.Is(err, ErrInvalid), errors.Is(err, api.ErrBadRequest):
		status = http.StatusBadRequest
	case errors.As(err, &mbe):
		status = http.StatusRequestEntityTooLarge
	case errors.Is(err, ErrNotFound):
		status = http.StatusNotFound
	case errors.Is(err, ErrRefused):
		status = http.StatusConflict
	}
	writeJSON(w, status, api.ErrorResponse{Error: err.Error()})
}
