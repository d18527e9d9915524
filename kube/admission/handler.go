package admission

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Paths the handler serves.
const (
	// MutatePath takes an AdmissionReview (POST) and answers one.
	MutatePath = "/mutate"
	// HealthPath answers "ok" (GET).
	HealthPath = "/healthz"
)

// MaxBodyBytes bounds an AdmissionReview. The API server takes requests
// of up to 3 MiB, and etcd stores objects of half that.
const MaxBodyBytes = 3 << 20

const reviewAPIVersion = "admission.k8s.io/v1"

// handler serves the webhook.
type handler struct {
	log *slog.Logger
	tr  *Translator // nil: no API server, no translation
}

// translateTimeout bounds the API calls of one translation.
const translateTimeout = 5 * time.Second

// NewHandler returns the webhook's HTTP handler: POST MutatePath takes an
// admission.k8s.io/v1 AdmissionReview and answers one (see Admit), GET
// HealthPath answers "ok". A body that is not an AdmissionReview is
// answered 400 (413 when over MaxBodyBytes) with one line. Denials are
// logged at info on log.
//
// With a translator, pods of namespaces that opt in (TranslateLabel) get
// their seed resources rewritten into DRA claims (Translator.Translate).
func NewHandler(log *slog.Logger, tr *Translator) http.Handler {
	h := &handler{log: log, tr: tr}
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+MutatePath, h.mutate)
	mux.HandleFunc("GET "+HealthPath, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = io.WriteString(w, "ok\n")
	})
	return mux
}

func (h *handler) mutate(w http.ResponseWriter, r *http.Request) {
	if ct := r.Header.Get("Content-Type"); ct != "" {
		if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
			http.Error(w, fmt.Sprintf("mgpu-webhook: content type %q, want application/json", ct), http.StatusUnsupportedMediaType)
			return
		}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	if err != nil {
		if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
			http.Error(w, fmt.Sprintf("mgpu-webhook: the AdmissionReview is over %d bytes", mbe.Limit), http.StatusRequestEntityTooLarge)
			return
		}
		http.Error(w, fmt.Sprintf("mgpu-webhook: read the AdmissionReview: %v", err), http.StatusBadRequest)
		return
	}
	resp, err := h.review(r.Context(), body)
	if err != nil {
		http.Error(w, "mgpu-webhook: "+err.Error(), http.StatusBadRequest)
		return
	}
	out, err := json.Marshal(&admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: reviewAPIVersion, Kind: "AdmissionReview"},
		Response: resp,
	})
	if err != nil {
		http.Error(w, "mgpu-webhook: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(out)
}

// review answers the AdmissionReview in body; an error is a body that is
// not one.
func (h *handler) review(ctx context.Context, body []byte) (*admissionv1.AdmissionResponse, error) {
	var rev admissionv1.AdmissionReview
	if err := json.Unmarshal(body, &rev); err != nil {
		return nil, fmt.Errorf("bad AdmissionReview: %w", err)
	}
	if rev.APIVersion != reviewAPIVersion || rev.Kind != "AdmissionReview" {
		return nil, fmt.Errorf("got apiVersion %q kind %q, want %s AdmissionReview", rev.APIVersion, rev.Kind, reviewAPIVersion)
	}
	req := rev.Request
	if req == nil {
		return nil, errors.New("the AdmissionReview has no request")
	}
	if req.UID == "" {
		return nil, errors.New("the AdmissionReview's request has no uid")
	}
	resp := &admissionv1.AdmissionResponse{UID: req.UID, Allowed: true}
	// Only pods being created are checked: the fields the webhook sets
	// are immutable once the pod exists, and other objects are not its.
	if req.Kind != (metav1.GroupVersionKind{Version: "v1", Kind: "Pod"}) || req.SubResource != "" || req.Operation != admissionv1.Create {
		return resp, nil
	}
	var pod corev1.Pod
	if err := json.Unmarshal(req.Object.Raw, &pod); err != nil {
		return nil, fmt.Errorf("bad pod in the AdmissionReview: %w", err)
	}
	name := pod.Name
	if name == "" {
		name = pod.GenerateName + "*"
	}
	name = req.Namespace + "/" + name

	ops, err := Admit(&pod)
	if err == nil && h.tr != nil && AsksSeed(&pod) {
		ops, err = h.translate(ctx, req.Namespace, &pod, ops)
	}
	if d := (*Denial)(nil); errors.As(err, &d) {
		h.log.Info("denied", "pod", name, "uid", req.UID, "reason", d.Error())
		resp.Allowed = false
		resp.Result = &metav1.Status{
			Status:  metav1.StatusFailure,
			Code:    http.StatusForbidden,
			Reason:  metav1.StatusReasonForbidden,
			Message: d.Error(),
		}
		return resp, nil
	}
	if err != nil {
		return nil, err
	}
	if len(ops) > 0 {
		p, err := json.Marshal(ops)
		if err != nil {
			return nil, err
		}
		pt := admissionv1.PatchTypeJSONPatch
		resp.Patch, resp.PatchType = p, &pt
	}
	h.log.Debug("admitted", "pod", name, "uid", req.UID, "operations", len(ops))
	return resp, nil
}

// translate returns the translation's operations in place of Admit's ops
// when the pod's namespace opted in, else ops. A namespace that cannot be
// read, or a template that cannot be made, refuses the pod (a pod asking
// for GPUs; the API server retries its controller's creation).
func (h *handler) translate(ctx context.Context, ns string, pod *corev1.Pod, ops []PatchOperation) ([]PatchOperation, error) {
	ctx, cancel := context.WithTimeout(ctx, translateTimeout)
	defer cancel()
	pod.Namespace = ns
	in, err := h.tr.OptedIn(ctx, ns)
	if err != nil {
		return nil, &Denial{Causes: []string{fmt.Sprintf("mgpu-webhook cannot tell whether the namespace opts into DRA (%s): %v", TranslateLabel, err)}}
	}
	if !in {
		return ops, nil
	}
	pol, err := podPolicy(pod) // Admit checked it
	if err != nil {
		return nil, err
	}
	tops, err := h.tr.Translate(ctx, pod, pol)
	if d := (*Denial)(nil); errors.As(err, &d) {
		return nil, err
	}
	if err != nil {
		return nil, &Denial{Causes: []string{"mgpu-webhook: " + err.Error()}}
	}
	return tops, nil
}
