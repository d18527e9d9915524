package admission

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
)

// reviewJSON returns an AdmissionReview of operation on an object of kind
// (e.g. "Pod" of group "") in namespace default.
func reviewJSON(uid, operation, group, kind, object string) string {
	return `{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{` +
		`"uid":"` + uid + `","kind":{"group":"` + group + `","version":"v1","kind":"` + kind + `"},` +
		`"resource":{"group":"","version":"v1","resource":"pods"},"namespace":"default",` +
		`"operation":"` + operation + `","userInfo":{"username":"u"},"object":` + object + `}}`
}

const (
	sharePod   = `{"apiVersion":"v1","kind":"Pod","metadata":{"generateName":"web-"},"spec":{"containers":[{"name":"c","image":"i","resources":{"limits":{"vke.volcengine.com/mgpu-core":"30","vke.volcengine.com/mgpu-memory":"1024"}}}]}}`
	zeroPod    = `{"apiVersion":"v1","kind":"Pod","metadata":{"name":"zero"},"spec":{"containers":[{"name":"c","image":"i","resources":{"limits":{"vke.volcengine.com/mgpu-core":"0"}}}]}}`
	plainPod   = `{"apiVersion":"v1","kind":"Pod","metadata":{"name":"plain"},"spec":{"containers":[{"name":"c","image":"i"}]}}`
	deployment = `{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"d"},"spec":{"template":{"spec":{"containers":[{"name":"c","resources":{"limits":{"vke.volcengine.com/mgpu-core":"0"}}}]}}}}`
)

func TestHandlerReview(t *testing.T) {
	t.Parallel()
	log, logs := testLogger()
	srv := httptest.NewTLSServer(NewHandler(log, nil))
	t.Cleanup(srv.Close) // after the parallel subtests
	for _, tc := range []struct {
		name    string
		body    string
		allowed bool
		patch   bool
		message string
	}{
		{name: "share", body: reviewJSON("u-1", "CREATE", "", "Pod", sharePod), allowed: true, patch: true},
		{
			name: "denied", body: reviewJSON("u-2", "CREATE", "", "Pod", zeroPod),
			message: coreLimit + ": 0" + coreHint,
		},
		{name: "no mgpu", body: reviewJSON("u-3", "CREATE", "", "Pod", plainPod), allowed: true},
		{name: "update", body: reviewJSON("u-4", "UPDATE", "", "Pod", zeroPod), allowed: true},
		{name: "not a pod", body: reviewJSON("u-5", "CREATE", "apps", "Deployment", deployment), allowed: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var in admissionv1.AdmissionReview
			if err := json.Unmarshal([]byte(tc.body), &in); err != nil {
				t.Fatal(err)
			}
			resp, err := srv.Client().Post(srv.URL+MutatePath, "application/json", strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/json" {
				t.Fatalf("%s %q: %s", resp.Status, resp.Header.Get("Content-Type"), body)
			}
			var out admissionv1.AdmissionReview
			if err := json.Unmarshal(body, &out); err != nil {
				t.Fatal(err)
			}
			r := out.Response
			if out.APIVersion != "admission.k8s.io/v1" || out.Kind != "AdmissionReview" || r == nil || r.UID != in.Request.UID {
				t.Fatalf("not an answer to %s: %s", in.Request.UID, body)
			}
			if r.Allowed != tc.allowed {
				t.Errorf("allowed %v, want %v: %s", r.Allowed, tc.allowed, body)
			}
			if tc.patch {
				if r.PatchType == nil || *r.PatchType != admissionv1.PatchTypeJSONPatch {
					t.Errorf("patch type %v", r.PatchType)
				}
				var ops []PatchOperation
				if err := json.Unmarshal(r.Patch, &ops); err != nil {
					t.Fatal(err)
				}
				var pod corev1.Pod
				if err := json.Unmarshal(applyPatch(t, in.Request.Object.Raw, ops), &pod); err != nil {
					t.Fatal(err)
				}
				if pod.Annotations[PolicyKey] != "fixed-share" || pod.Spec.Affinity == nil {
					t.Errorf("patched pod %+v", pod)
				}
			} else if r.Patch != nil || r.PatchType != nil {
				t.Errorf("a patch: %s", body)
			}
			if tc.message != "" {
				if r.Result == nil || r.Result.Message != tc.message || r.Result.Code != http.StatusForbidden {
					t.Errorf("result %+v, want message %q", r.Result, tc.message)
				}
			}
		})
	}
	t.Cleanup(func() { // after the parallel subtests
		l := logs.String()
		if strings.Count(l, "msg=denied") != 1 || !strings.Contains(l, "pod=default/zero") || !strings.Contains(l, "0 is not a valid mgpu-core") {
			t.Errorf("log, want one denial of default/zero:\n%s", l)
		}
		if !strings.Contains(l, "pod=default/web-*") {
			t.Errorf("log lacks the generated name:\n%s", l)
		}
	})
}

func TestHandlerBadRequests(t *testing.T) {
	t.Parallel()
	log, _ := testLogger()
	srv := httptest.NewTLSServer(NewHandler(log, nil))
	t.Cleanup(srv.Close)
	huge := reviewJSON("u", "CREATE", "", "Pod", `{"metadata":{"annotations":{"x":"`+strings.Repeat("x", MaxBodyBytes)+`"}}}`)
	for _, tc := range []struct {
		name        string
		method      string
		path        string
		contentType string
		body        string
		status      int
		message     string
	}{
		{name: "not JSON", body: "{", status: 400, message: "mgpu-webhook: bad AdmissionReview: unexpected end of JSON input"},
		{name: "empty", body: "", status: 400, message: "mgpu-webhook: bad AdmissionReview: unexpected end of JSON input"},
		{name: "array", body: "[]", status: 400, message: "mgpu-webhook: bad AdmissionReview: json: cannot unmarshal array"},
		{
			name: "v1beta1", body: strings.Replace(reviewJSON("u", "CREATE", "", "Pod", plainPod), "admission.k8s.io/v1", "admission.k8s.io/v1beta1", 1),
			status: 400, message: `mgpu-webhook: got apiVersion "admission.k8s.io/v1beta1" kind "AdmissionReview", want admission.k8s.io/v1 AdmissionReview`,
		},
		{name: "wrong kind", body: `{"apiVersion":"admission.k8s.io/v1","kind":"Pod"}`, status: 400, message: `mgpu-webhook: got apiVersion "admission.k8s.io/v1" kind "Pod", want admission.k8s.io/v1 AdmissionReview`},
		{name: "no request", body: `{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}`, status: 400, message: "mgpu-webhook: the AdmissionReview has no request"},
		{name: "no uid", body: reviewJSON("", "CREATE", "", "Pod", plainPod), status: 400, message: "mgpu-webhook: the AdmissionReview's request has no uid"},
		{name: "bad pod", body: reviewJSON("u", "CREATE", "", "Pod", `{"spec":{"containers":"c"}}`), status: 400, message: "mgpu-webhook: bad pod in the AdmissionReview: json: cannot unmarshal string"},
		{name: "no pod", body: reviewJSON("u", "CREATE", "", "Pod", `null`), status: 400, message: "mgpu-webhook: bad pod in the AdmissionReview"},
		{name: "bad quantity", body: reviewJSON("u", "CREATE", "", "Pod", `{"spec":{"containers":[{"resources":{"limits":{"vke.volcengine.com/mgpu-core":"lots"}}}]}}`), status: 400, message: "mgpu-webhook: bad pod in the AdmissionReview: quantities must match"},
		{name: "huge", body: huge, status: 413, message: "mgpu-webhook: the AdmissionReview is over 3145728 bytes"},
		{name: "content type", contentType: "text/plain", body: "{}", status: 415, message: `mgpu-webhook: content type "text/plain", want application/json`},
		{name: "GET", method: http.MethodGet, status: 405},
		{name: "elsewhere", path: "/validate", body: "{}", status: 404},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			method, path, ct := tc.method, tc.path, tc.contentType
			if method == "" {
				method = http.MethodPost
			}
			if path == "" {
				path = MutatePath
			}
			if ct == "" {
				ct = "application/json"
			}
			req, err := http.NewRequest(method, srv.URL+path, bytes.NewReader([]byte(tc.body)))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Content-Type", ct)
			resp, err := srv.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.status {
				t.Errorf("status %d, want %d: %s", resp.StatusCode, tc.status, body)
			}
			if tc.message == "" {
				return
			}
			if b := string(body); !strings.HasPrefix(b, tc.message) || strings.Count(b, "\n") != 1 || !strings.HasSuffix(b, "\n") {
				t.Errorf("body %q, want one line starting %q", b, tc.message)
			}
		})
	}
}

func TestHandlerHealth(t *testing.T) {
	t.Parallel()
	log, _ := testLogger()
	srv := httptest.NewTLSServer(NewHandler(log, nil))
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + HealthPath)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || string(body) != "ok\n" {
		t.Errorf("%s %q", resp.Status, body)
	}
}

// FuzzReview feeds the handler's decoding and Admit arbitrary reviews: it
// must answer or refuse, never panic, and answer the request it got.
func FuzzReview(f *testing.F) {
	for _, pod := range []string{sharePod, zeroPod, plainPod, `{"metadata":{"annotations":{"vke.volcengine.com/mgpu-compute-policy":"x"}}}`,
		`{"spec":{"affinity":{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{},{"matchFields":[]}]}}},"containers":[{"resources":{"requests":{"vke.volcengine.com/mgpu-core":"100"}}}]}}`} {
		f.Add([]byte(reviewJSON("u", "CREATE", "", "Pod", pod)))
	}
	f.Add([]byte(`{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u"}}`))
	log, _ := testLogger()
	h := &handler{log: log}
	f.Fuzz(func(t *testing.T, body []byte) {
		resp, err := h.review(context.Background(), body)
		if err != nil {
			return
		}
		var rev admissionv1.AdmissionReview
		if err := json.Unmarshal(body, &rev); err != nil {
			t.Fatalf("answered a review that does not decode: %v", err)
		}
		if resp.UID != rev.Request.UID {
			t.Fatalf("uid %q, want %q", resp.UID, rev.Request.UID)
		}
		if !resp.Allowed && (resp.Result == nil || resp.Result.Message == "") {
			t.Fatalf("denied without a message")
		}
		if resp.Patch != nil {
			var ops []PatchOperation
			if err := json.Unmarshal(resp.Patch, &ops); err != nil || len(ops) == 0 {
				t.Fatalf("patch %s: %v", resp.Patch, err)
			}
		}
	})
}
