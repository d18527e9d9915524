package admission

import (
	"encoding/json"
	"errors"
	"reflect"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

const (
	coreLimit = "spec.containers[0].resources.limits[vke.volcengine.com/mgpu-core]"
	memLimit  = "spec.containers[0].resources.limits[vke.volcengine.com/mgpu-memory]"
	coreHint  = " is not a valid mgpu-core; set 1 to 100 (a share of one GPU) or a multiple of 100 (whole GPUs)"
	badPolicy = `metadata.annotations[vke.volcengine.com/mgpu-compute-policy]: "burst" is not a compute policy; set one of fixed-share, guaranteed-burst-share, native-burst-share`
)

// res is a container's resources: limits, and requests when given.
func res(limits map[corev1.ResourceName]string, requests ...map[corev1.ResourceName]string) corev1.ResourceRequirements {
	list := func(m map[corev1.ResourceName]string) corev1.ResourceList {
		l := corev1.ResourceList{}
		for k, v := range m {
			l[k] = resource.MustParse(v)
		}
		return l
	}
	r := corev1.ResourceRequirements{}
	if limits != nil {
		r.Limits = list(limits)
	}
	if len(requests) > 0 {
		r.Requests = list(requests[0])
	}
	return r
}

func mgpu(core, mem string) corev1.ResourceRequirements {
	m := map[corev1.ResourceName]string{}
	if core != "" {
		m[ResourceCore] = core
	}
	if mem != "" {
		m[ResourceMemory] = mem
	}
	return res(m)
}

// podOf returns a pod of containers with resources rs.
func podOf(rs ...corev1.ResourceRequirements) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "default"}}
	for _, r := range rs {
		p.Spec.Containers = append(p.Spec.Containers, corev1.Container{Name: "c", Image: "i", Resources: r})
	}
	return p
}

func withAnnotation(p *corev1.Pod, v string) *corev1.Pod {
	p.Annotations = map[string]string{PolicyKey: v}
	return p
}

func TestAdmitValidation(t *testing.T) {
	t.Parallel()
	initPod := podOf(mgpu("30", "1024"))
	initPod.Spec.InitContainers = []corev1.Container{{Name: "init", Resources: mgpu("0", "")}}
	selected := func(p *corev1.Pod, v string) *corev1.Pod {
		p.Spec.NodeSelector = map[string]string{PolicyKey: v, "zone": "a"}
		return p
	}
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		want []string // causes; nil: admitted
		ops  bool     // admitted with operations
	}{
		{name: "no mgpu", pod: podOf(res(map[corev1.ResourceName]string{"cpu": "1", "nvidia.com/gpu": "1"}))},
		{name: "no containers", pod: podOf()},
		{name: "share", pod: podOf(mgpu("30", "1024")), ops: true},
		{name: "one", pod: podOf(mgpu("1", "1")), ops: true},
		{name: "whole GPU without memory", pod: podOf(mgpu("100", "")), ops: true},
		{name: "two GPUs without memory", pod: podOf(mgpu("200", "")), ops: true},
		{name: "ten GPUs as 1k", pod: podOf(mgpu("1k", "")), ops: true},
		{name: "whole GPU with memory", pod: podOf(mgpu("200", "81920")), ops: true},
		{name: "requests only", pod: podOf(res(nil, map[corev1.ResourceName]string{ResourceCore: "50", ResourceMemory: "512"})), ops: true},
		{
			name: "requests equal limits",
			pod:  podOf(res(map[corev1.ResourceName]string{ResourceCore: "50", ResourceMemory: "512"}, map[corev1.ResourceName]string{ResourceCore: "50", ResourceMemory: "512"})),
			ops:  true,
		},
		{name: "core 0", pod: podOf(mgpu("0", "1024")), want: []string{coreLimit + ": 0" + coreHint}},
		{name: "core 150", pod: podOf(mgpu("150", "1024")), want: []string{coreLimit + ": 150" + coreHint}},
		{name: "core 101", pod: podOf(mgpu("101", "")), want: []string{coreLimit + ": 101" + coreHint}},
		{name: "core 500m", pod: podOf(mgpu("500m", "1024")), want: []string{coreLimit + ": 500m" + coreHint}},
		{name: "core 30.5", pod: podOf(mgpu("30.5", "1024")), want: []string{coreLimit + ": 30500m" + coreHint}},
		{name: "core negative", pod: podOf(mgpu("-30", "1024")), want: []string{coreLimit + ": -30" + coreHint}},
		{
			name: "share without memory", pod: podOf(mgpu("50", "")),
			want: []string{memLimit + ": missing; a share of one GPU (mgpu-core 50) needs mgpu-memory, a whole number of MiB above 0"},
		},
		{
			name: "memory without core", pod: podOf(mgpu("", "1024")),
			want: []string{memLimit + ": mgpu-memory needs mgpu-core; set " + coreLimit + " too"},
		},
		{name: "memory 0", pod: podOf(mgpu("50", "0")), want: []string{memLimit + ": 0 is not a valid mgpu-memory; set a whole number of MiB above 0"}},
		{name: "memory fractional", pod: podOf(mgpu("50", "1.5")), want: []string{memLimit + ": 1500m is not a valid mgpu-memory; set a whole number of MiB above 0"}},
		{name: "memory in bytes", pod: podOf(mgpu("50", "1Gi")), want: []string{memLimit + ": 1Gi is not a valid mgpu-memory; it is a number of MiB, e.g. 1024 for 1Gi"}},
		{name: "memory 1Ki", pod: podOf(mgpu("50", "1Ki")), want: []string{memLimit + ": 1Ki is not a valid mgpu-memory; set a whole number of MiB above 0"}},
		{
			name: "request differs",
			pod:  podOf(res(map[corev1.ResourceName]string{ResourceCore: "50", ResourceMemory: "512"}, map[corev1.ResourceName]string{ResourceCore: "30"})),
			want: []string{"spec.containers[0].resources.requests[vke.volcengine.com/mgpu-core]: 30 is not the limit 50; an mgpu request must equal its limit (or be left out)"},
		},
		{
			name: "bad request only",
			pod:  podOf(res(nil, map[corev1.ResourceName]string{ResourceCore: "0"})),
			want: []string{"spec.containers[0].resources.requests[vke.volcengine.com/mgpu-core]: 0" + coreHint},
		},
		{name: "bad policy", pod: withAnnotation(podOf(mgpu("30", "1024")), "burst"), want: []string{badPolicy}},
		{name: "bad policy without mgpu", pod: withAnnotation(podOf(res(nil)), "burst"), want: []string{badPolicy}},
		{name: "empty policy", pod: withAnnotation(podOf(mgpu("30", "1024")), ""), want: []string{
			`metadata.annotations[vke.volcengine.com/mgpu-compute-policy]: "" is not a compute policy; set one of fixed-share, guaranteed-burst-share, native-burst-share`,
		}},
		{name: "policy without mgpu", pod: withAnnotation(podOf(res(nil)), "native-burst-share")},
		{name: "bad class", pod: withClass(podOf(mgpu("30", "1024")), "batch"), want: []string{
			`metadata.annotations[vke.volcengine.com/mgpu-class]: "batch" is not a priority class; set online or offline (offline runs only on GPU time online pods leave, on GPUs of online_offline_switch 1 or 2)`,
		}},
		{name: "offline class", pod: withClass(podOf(mgpu("30", "1024")), "offline"), ops: true},
		{name: "policy", pod: withAnnotation(podOf(mgpu("30", "1024")), "guaranteed-burst-share"), ops: true},
		{
			name: "init container", pod: initPod,
			want: []string{"spec.initContainers[0].resources.limits[vke.volcengine.com/mgpu-core]: 0" + coreHint},
		},
		{
			name: "second container", pod: podOf(mgpu("30", "1024"), mgpu("", "")),
			ops: true,
		},
		{
			name: "several mistakes", pod: withAnnotation(podOf(mgpu("30", "1024"), mgpu("150", "0"), mgpu("", "1")), "burst"),
			want: []string{
				badPolicy,
				"spec.containers[1].resources.limits[vke.volcengine.com/mgpu-core]: 150" + coreHint,
				"spec.containers[1].resources.limits[vke.volcengine.com/mgpu-memory]: 0 is not a valid mgpu-memory; set a whole number of MiB above 0",
				"spec.containers[2].resources.limits[vke.volcengine.com/mgpu-memory]: mgpu-memory needs mgpu-core; set spec.containers[2].resources.limits[vke.volcengine.com/mgpu-core] too",
			},
		},
		{name: "node selector of the policy", pod: selected(podOf(mgpu("30", "1024")), "fixed-share"), ops: true},
		{
			name: "node selector of another policy", pod: selected(podOf(mgpu("30", "1024")), "guaranteed-burst-share"),
			want: []string{`spec.nodeSelector[vke.volcengine.com/mgpu-compute-policy]: "guaranteed-burst-share" is not the pod's compute policy fixed-share (the default without metadata.annotations[vke.volcengine.com/mgpu-compute-policy]); set that annotation to "guaranteed-burst-share", or remove the node selector`},
		},
		{
			name: "node selector against the annotation", pod: selected(withAnnotation(podOf(mgpu("30", "1024")), "native-burst-share"), "fixed-share"),
			want: []string{`spec.nodeSelector[vke.volcengine.com/mgpu-compute-policy]: "fixed-share" is not the pod's compute policy native-burst-share (from metadata.annotations[vke.volcengine.com/mgpu-compute-policy]); set that annotation to "fixed-share", or remove the node selector`},
		},
		{name: "node selector without mgpu", pod: selected(podOf(res(nil)), "bogus")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ops, err := Admit(tc.pod)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("denied: %v", err)
				}
				if (len(ops) > 0) != tc.ops {
					t.Errorf("operations %+v, want some: %v", ops, tc.ops)
				}
				return
			}
			var d *Denial
			if !errors.As(err, &d) {
				t.Fatalf("got %v (operations %+v), want a denial", err, ops)
			}
			if !slices.Equal(d.Causes, tc.want) {
				t.Errorf("causes\n%q\nwant\n%q", d.Causes, tc.want)
			}
		})
	}
}

// TestAdmitJSON decodes the resources as the API server sends them.
func TestAdmitJSON(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, limits, want string
	}{
		{name: "numbers", limits: `{"vke.volcengine.com/mgpu-core": 30, "vke.volcengine.com/mgpu-memory": 1024}`},
		{name: "strings", limits: `{"vke.volcengine.com/mgpu-core": "30", "vke.volcengine.com/mgpu-memory": "1024"}`},
		{name: "150", limits: `{"vke.volcengine.com/mgpu-core": 150}`, want: coreLimit + ": 150" + coreHint},
		{name: "500m", limits: `{"vke.volcengine.com/mgpu-core": "500m", "vke.volcengine.com/mgpu-memory": 1}`, want: coreLimit + ": 500m" + coreHint},
		{name: "0.5", limits: `{"vke.volcengine.com/mgpu-core": 0.5, "vke.volcengine.com/mgpu-memory": 1}`, want: coreLimit + ": 500m" + coreHint},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var pod corev1.Pod
			if err := json.Unmarshal([]byte(`{"spec":{"containers":[{"name":"c","resources":{"limits":`+tc.limits+`}}]}}`), &pod); err != nil {
				t.Fatal(err)
			}
			_, err := Admit(&pod)
			got := ""
			if err != nil {
				got = err.Error()
			}
			if got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestDenialError(t *testing.T) {
	t.Parallel()
	d := &Denial{Causes: []string{"a: x", "b: y"}}
	if got := d.Error(); got != "a: x; b: y" {
		t.Errorf("got %q", got)
	}
}

// term is a node selector term of expressions.
func term(es ...corev1.NodeSelectorRequirement) corev1.NodeSelectorTerm {
	return corev1.NodeSelectorTerm{MatchExpressions: es}
}

var (
	zoneA   = corev1.NodeSelectorRequirement{Key: "zone", Operator: corev1.NodeSelectorOpIn, Values: []string{"a"}}
	gpuNode = corev1.NodeSelectorRequirement{Key: "gpu", Operator: corev1.NodeSelectorOpExists}
	byName  = corev1.NodeSelectorRequirement{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{"n1"}}
	fixed   = Requirement(DefaultPolicy)
)

func TestAdmitPatch(t *testing.T) {
	t.Parallel()
	preferred := []corev1.PreferredSchedulingTerm{{Weight: 1, Preference: term(zoneA)}}
	antiAffinity := &corev1.PodAntiAffinity{RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{{TopologyKey: "zone"}}}
	required := func(ts ...corev1.NodeSelectorTerm) *corev1.Affinity {
		return &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
			RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: ts},
		}}
	}
	for _, tc := range []struct {
		name        string
		json        string // of the pod's metadata and spec, besides its container
		annotations map[string]string
		affinity    *corev1.Affinity // want
		ops         int              // want this many operations
	}{
		{
			name:        "nothing",
			json:        `{}`,
			annotations: map[string]string{PolicyKey: "fixed-share"},
			affinity:    required(term(fixed)),
			ops:         2,
		},
		{
			name:        "empty annotations and null affinity",
			json:        `{"metadata":{"annotations":{}},"spec":{"affinity":null}}`,
			annotations: map[string]string{PolicyKey: "fixed-share"},
			affinity:    required(term(fixed)),
			ops:         2,
		},
		{
			name:        "other annotations",
			json:        `{"metadata":{"annotations":{"a/b~c":"d"}}}`,
			annotations: map[string]string{"a/b~c": "d", PolicyKey: "fixed-share"},
			affinity:    required(term(fixed)),
			ops:         2,
		},
		{
			name:        "policy annotation",
			json:        `{"metadata":{"annotations":{"vke.volcengine.com/mgpu-compute-policy":"native-burst-share"}}}`,
			annotations: map[string]string{PolicyKey: "native-burst-share"},
			affinity:    required(term(Requirement(2))),
			ops:         1,
		},
		{
			name:        "pod anti-affinity only",
			json:        `{"spec":{"affinity":{"podAntiAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":[{"topologyKey":"zone"}]}}}}`,
			annotations: map[string]string{PolicyKey: "fixed-share"},
			affinity: &corev1.Affinity{
				NodeAffinity: required(term(fixed)).NodeAffinity, PodAntiAffinity: antiAffinity,
			},
			ops: 2,
		},
		{
			name:        "empty affinity",
			json:        `{"spec":{"affinity":{}}}`,
			annotations: map[string]string{PolicyKey: "fixed-share"},
			affinity:    required(term(fixed)),
			ops:         2,
		},
		{
			name:        "preferred only",
			json:        `{"spec":{"affinity":{"nodeAffinity":{"preferredDuringSchedulingIgnoredDuringExecution":[{"weight":1,"preference":{"matchExpressions":[{"key":"zone","operator":"In","values":["a"]}]}}]}}}}`,
			annotations: map[string]string{PolicyKey: "fixed-share"},
			affinity: &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
				RequiredDuringSchedulingIgnoredDuringExecution:  &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{term(fixed)}},
				PreferredDuringSchedulingIgnoredDuringExecution: preferred,
			}},
			ops: 2,
		},
		{
			name:        "no terms",
			json:        `{"spec":{"affinity":{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[]}}}}}`,
			annotations: map[string]string{PolicyKey: "fixed-share"},
			affinity:    required(term(fixed)),
			ops:         2,
		},
		{
			name: "several terms",
			json: `{"spec":{"affinity":{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[
				{"matchExpressions":[{"key":"zone","operator":"In","values":["a"]}]},
				{"matchExpressions":[{"key":"gpu","operator":"Exists"}]},
				{"matchExpressions":[],"matchFields":[{"key":"metadata.name","operator":"In","values":["n1"]}]},
				{"matchFields":[{"key":"metadata.name","operator":"In","values":["n1"]}]},
				{}
			]}}}}}`,
			annotations: map[string]string{PolicyKey: "fixed-share"},
			affinity: required(
				term(zoneA, fixed),
				term(gpuNode, fixed),
				corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{fixed}, MatchFields: []corev1.NodeSelectorRequirement{byName}},
				corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{fixed}, MatchFields: []corev1.NodeSelectorRequirement{byName}},
				corev1.NodeSelectorTerm{}, // matches no node, and still none
			),
			ops: 5,
		},
		{
			name: "requirement in one term",
			json: `{"metadata":{"annotations":{"vke.volcengine.com/mgpu-compute-policy":"fixed-share"}},"spec":{"affinity":{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[
				{"matchExpressions":[{"key":"vke.volcengine.com/mgpu-compute-policy","operator":"In","values":["fixed-share"]}]},
				{"matchExpressions":[{"key":"zone","operator":"In","values":["a"]}]}
			]}}}}}`,
			annotations: map[string]string{PolicyKey: "fixed-share"},
			affinity:    required(term(fixed), term(zoneA, fixed)),
			ops:         1,
		},
		{
			name: "another requirement on the key",
			json: `{"spec":{"affinity":{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[
				{"matchExpressions":[{"key":"vke.volcengine.com/mgpu-compute-policy","operator":"In","values":["fixed-share","native-burst-share"]}]}
			]}}}}}`,
			annotations: map[string]string{PolicyKey: "fixed-share"},
			affinity: required(term(
				corev1.NodeSelectorRequirement{Key: PolicyKey, Operator: corev1.NodeSelectorOpIn, Values: []string{"fixed-share", "native-burst-share"}},
				fixed,
			)),
			ops: 2,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			doc := mergeJSON(t, `{"metadata":{"name":"p"},"spec":{"containers":[{"name":"c","resources":{"limits":{"vke.volcengine.com/mgpu-core":"30","vke.volcengine.com/mgpu-memory":"1024"}}}]}}`, tc.json)
			var pod corev1.Pod
			if err := json.Unmarshal(doc, &pod); err != nil {
				t.Fatal(err)
			}
			ops, err := Admit(&pod)
			if err != nil {
				t.Fatal(err)
			}
			if len(ops) != tc.ops {
				t.Errorf("%d operations, want %d: %+v", len(ops), tc.ops, ops)
			}
			patched := applyPatch(t, doc, ops)
			var got corev1.Pod
			if err := json.Unmarshal(patched, &got); err != nil {
				t.Fatalf("the patched pod: %v\n%s", err, patched)
			}
			if !reflect.DeepEqual(got.Annotations, tc.annotations) {
				t.Errorf("annotations %v, want %v", got.Annotations, tc.annotations)
			}
			if !reflect.DeepEqual(normalize(got.Spec.Affinity), normalize(tc.affinity)) {
				g, _ := json.Marshal(got.Spec.Affinity)
				w, _ := json.Marshal(tc.affinity)
				t.Errorf("affinity\n%s\nwant\n%s", g, w)
			}
			if got.Spec.Containers[0].Name != "c" || got.Name != "p" {
				t.Errorf("the patch changed the rest of the pod: %s", patched)
			}
			// Admitted again, the patched pod needs nothing more.
			if again, err := Admit(&got); err != nil || len(again) > 0 {
				t.Errorf("again: %+v, %v", again, err)
			}
		})
	}
}

// normalize makes empty lists of an affinity nil, as JSON does not tell
// them apart.
func normalize(a *corev1.Affinity) *corev1.Affinity {
	if a == nil || a.NodeAffinity == nil || a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		return a
	}
	a = a.DeepCopy()
	for i, t := range a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
		if len(t.MatchExpressions) == 0 {
			t.MatchExpressions = nil
		}
		if len(t.MatchFields) == 0 {
			t.MatchFields = nil
		}
		a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms[i] = t
	}
	return a
}

func TestEscape(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		PolicyKey: "vke.volcengine.com~1mgpu-compute-policy",
		"a~b/c~1": "a~0b~1c~01",
		"plain":   "plain",
	} {
		if got := escape(in); got != want {
			t.Errorf("escape(%q) = %q, want %q", in, got, want)
		}
	}
}

// withClass sets the pod's priority class annotation.
func withClass(p *corev1.Pod, v string) *corev1.Pod {
	if p.Annotations == nil {
		p.Annotations = map[string]string{}
	}
	p.Annotations[ClassKey] = v
	return p
}
