package admission

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/kube/dranames"
)

// TranslateLabel is the namespace label that opts a namespace's pods into
// the translation of the seeds' extended resources into DRA claims
// ("true"): docs/kubernetes.md "DRA".
const TranslateLabel = "gpu.mgpu.io/translate"

// ACK's resources (core_mem, cgpu).
const (
	ResourceACKCore   corev1.ResourceName = "aliyun.com/gpu-core.percentage"
	ResourceACKMemory corev1.ResourceName = "aliyun.com/gpu-mem"
)

// TemplatePrefix starts the name of every ResourceClaimTemplate the
// webhook makes; a pod claim of such a template is a translated request.
const TemplatePrefix = "mgpu-"

// managedBy labels the templates the webhook makes.
const managedBy = "mgpu-webhook"

// maxACKGiB bounds aliyun.com/gpu-mem, and maxMemoryMiB a request's MiB
// (as the agent and the hook do: 16 TiB).
const (
	maxACKGiB    = 16384
	maxMemoryMiB = 1 << 24
)

// shape is one container's request as a claim: cores and memory of one
// GPU, or count whole GPUs (memory per GPU, 0: all of it). burst: any
// policy but fixed-share (ACK's cgpu: compute shared under the GPU's
// burst policy).
type shape struct {
	cores int
	mib   uint64
	count int
	burst bool
}

// templateName names the per-namespace template of a request shape under
// policy p.
func (s shape) templateName(p policy.Policy) string {
	pol := p.String()
	if s.burst {
		pol = "burst"
	}
	if s.count > 0 {
		if s.mib > 0 {
			return fmt.Sprintf("%s%s-%dgpu-%dmi", TemplatePrefix, pol, s.count, s.mib)
		}
		return fmt.Sprintf("%s%s-%dgpu", TemplatePrefix, pol, s.count)
	}
	return fmt.Sprintf("%s%s-%dc-%dmi", TemplatePrefix, pol, s.cores, s.mib)
}

// template is the ResourceClaimTemplate of the shape under policy p: one
// request "gpu" of DeviceClass gpu.mgpu.io whose devices' policy attribute
// is p (any burst policy for a burst shape), with the shape's capacity;
// whole GPUs distinct by uuid.
func (s shape) template(ns string, p policy.Policy) *resourcev1.ResourceClaimTemplate {
	attr := `device.attributes["` + dranames.Driver + `"].` + string(dranames.AttrPolicy)
	sel := attr + ` == "` + p.String() + `"`
	if s.burst {
		sel = attr + ` != "` + policy.FixedShare.String() + `"`
	}
	req := &resourcev1.ExactDeviceRequest{
		DeviceClassName: dranames.DeviceClass,
		Selectors:       []resourcev1.DeviceSelector{{CEL: &resourcev1.CELDeviceSelector{Expression: sel}}},
		AllocationMode:  resourcev1.DeviceAllocationModeExactCount,
		Count:           1,
	}
	capacity := map[resourcev1.QualifiedName]resource.Quantity{}
	if s.mib > 0 {
		capacity[dranames.CapMemory] = resource.MustParse(fmt.Sprintf("%dMi", s.mib))
	}
	if s.count == 0 {
		capacity[dranames.CapCores] = *resource.NewQuantity(int64(s.cores), resource.DecimalSI)
	}
	if len(capacity) > 0 {
		req.Capacity = &resourcev1.CapacityRequirements{Requests: capacity}
	}
	claim := resourcev1.DeviceClaim{Requests: []resourcev1.DeviceRequest{{Name: "gpu", Exactly: req}}}
	if s.count > 1 {
		req.Count = int64(s.count)
		claim.Constraints = []resourcev1.DeviceConstraint{{Requests: []string{"gpu"},
			DistinctAttribute: ptr(resourcev1.FullyQualifiedName(dranames.Driver + "/" + string(dranames.AttrUUID)))}}
	}
	return &resourcev1.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: s.templateName(p), Namespace: ns,
			Labels: map[string]string{"app.kubernetes.io/managed-by": managedBy}},
		Spec: resourcev1.ResourceClaimTemplateSpec{Spec: resourcev1.ResourceClaimSpec{Devices: claim}},
	}
}

// containerShape reads a container's seed resources (limits, else
// requests; the API server makes them equal for extended resources): the
// shape and the resources it replaces, ok false when it asks for none.
// mgpu's keys were validated by validateContainers; ACK's are checked
// here.
func containerShape(c *corev1.Container) (s shape, names []corev1.ResourceName, ok bool, err error) {
	get := func(n corev1.ResourceName) (int64, bool, error) {
		q, ok := c.Resources.Limits[n]
		if !ok {
			q, ok = c.Resources.Requests[n]
		}
		if !ok {
			return 0, false, nil
		}
		names = append(names, n)
		v, whole := q.AsInt64()
		if !whole || v < 1 {
			return 0, true, fmt.Errorf("%s %s is not a whole number above 0", n, q.String())
		}
		return v, true, nil
	}
	core, hasCore, err := get(ResourceCore)
	if err != nil {
		return s, nil, false, err
	}
	mem, hasMem, err := get(ResourceMemory)
	if err != nil {
		return s, nil, false, err
	}
	ackCore, hasACKCore, err := get(ResourceACKCore)
	if err != nil {
		return s, nil, false, err
	}
	ackMem, hasACKMem, err := get(ResourceACKMemory)
	if err != nil {
		return s, nil, false, err
	}
	switch {
	case (hasCore || hasMem) && (hasACKCore || hasACKMem):
		return s, nil, false, fmt.Errorf("it asks for both %s and %s; use one vendor's keys", ResourceCore, ResourceACKMemory)
	case hasCore:
	case hasMem:
		return s, nil, false, fmt.Errorf("%s needs %s", ResourceMemory, ResourceCore)
	case hasACKCore:
		if !hasACKMem {
			return s, nil, false, fmt.Errorf("%s needs %s", ResourceACKCore, ResourceACKMemory)
		}
		core = ackCore
		mem, hasMem = ackMem*1024, true
	case hasACKMem:
		if ackMem > maxACKGiB {
			return s, nil, false, fmt.Errorf("%s %d is over %d GiB", ResourceACKMemory, ackMem, maxACKGiB)
		}
		return shape{cores: 1, mib: uint64(ackMem) * 1024, burst: true}, names, true, nil
	default:
		return s, nil, false, nil
	}
	if ackMem > maxACKGiB {
		return s, nil, false, fmt.Errorf("%s %d is over %d GiB", ResourceACKMemory, ackMem, maxACKGiB)
	}
	if uint64(mem) > maxMemoryMiB {
		return s, nil, false, fmt.Errorf("%d MiB is over %d MiB", mem, maxMemoryMiB)
	}
	switch {
	case core < 100:
		if !hasMem {
			return s, nil, false, fmt.Errorf("a share of %d%% of a GPU needs its memory", core)
		}
		return shape{cores: int(core), mib: uint64(mem)}, names, true, nil
	case core%100 != 0:
		return s, nil, false, fmt.Errorf("%d%% is not 1 to 100 or a multiple of 100", core)
	}
	n := core / 100
	if n > resourcev1.AllocationResultsMaxSize {
		return s, nil, false, fmt.Errorf("%d whole GPUs is over the %d devices a claim may hold", n, resourcev1.AllocationResultsMaxSize)
	}
	s = shape{count: int(n)}
	if hasMem {
		if uint64(mem) < uint64(n) {
			return s, nil, false, fmt.Errorf("%d MiB across %d GPUs is under 1 MiB each", mem, n)
		}
		s.mib = uint64(mem) / uint64(n)
	}
	return s, names, true, nil
}

// Translator rewrites the seeds' requests of pods in namespaces that opt
// in (TranslateLabel) into claims of per-namespace ResourceClaimTemplates.
type Translator struct {
	client kubernetes.Interface
}

// NewTranslator returns a translator that reads namespaces and makes
// templates with client.
func NewTranslator(client kubernetes.Interface) *Translator { return &Translator{client: client} }

// OptedIn reports whether namespace ns opted into the translation.
func (tr *Translator) OptedIn(ctx context.Context, ns string) (bool, error) {
	n, err := tr.client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
	if err != nil {
		return false, fmt.Errorf("namespace %s: %w", ns, err)
	}
	return n.Labels[TranslateLabel] == "true", nil
}

// Translate returns the operations that turn pod's seed resources into
// claims, after making (or finding) the templates in its namespace; none
// when no container asks for them. A container's request becomes a pod
// claim entry "mgpu-<container>" of the template of its shape under
// policy pol, named in the container's resources.claims, and its extended
// resources are removed; the pod's policy annotation is set to pol (but
// for ACK's memory-only request, which runs under its GPU's burst policy).
// Bad values are a *Denial.
func (tr *Translator) Translate(ctx context.Context, pod *corev1.Pod, pol policy.Policy) ([]PatchOperation, error) {
	var (
		ops        []PatchOperation
		entries    []corev1.PodResourceClaim
		d          Denial
		needPolicy bool
	)
	for _, l := range []struct {
		path string
		ctrs []corev1.Container
	}{{"/spec/initContainers", pod.Spec.InitContainers}, {"/spec/containers", pod.Spec.Containers}} {
		for i := range l.ctrs {
			c := &l.ctrs[i]
			s, names, ok, err := containerShape(c)
			if err != nil {
				d.add("%s[%d] (%s): %v", strings.TrimPrefix(l.path, "/"), i, c.Name, err)
				continue
			}
			if !ok {
				continue
			}
			needPolicy = needPolicy || !s.burst
			tmpl, err := tr.ensureTemplate(ctx, s.template(pod.Namespace, pol))
			if err != nil {
				return nil, err
			}
			entry := "mgpu-" + c.Name
			entries = append(entries, corev1.PodResourceClaim{Name: entry, ResourceClaimTemplateName: ptr(tmpl)})
			base := fmt.Sprintf("%s/%d/resources", l.path, i)
			for _, n := range names {
				if _, ok := c.Resources.Limits[n]; ok {
					ops = append(ops, PatchOperation{Op: "remove", Path: base + "/limits/" + escape(string(n))})
				}
				if _, ok := c.Resources.Requests[n]; ok {
					ops = append(ops, PatchOperation{Op: "remove", Path: base + "/requests/" + escape(string(n))})
				}
			}
			if c.Resources.Claims == nil {
				ops = append(ops, PatchOperation{Op: "add", Path: base + "/claims", Value: []corev1.ResourceClaim{{Name: entry}}})
			} else {
				ops = append(ops, PatchOperation{Op: "add", Path: base + "/claims/-", Value: corev1.ResourceClaim{Name: entry}})
			}
		}
	}
	if len(d.Causes) > 0 {
		return nil, &d
	}
	if len(entries) == 0 {
		return nil, nil
	}
	if needPolicy {
		// The claim selects GPUs of the policy; the annotation says it to
		// the node agent, which checks it against the GPU's.
		ops = append(annotationOps(pod, pol), ops...)
	}
	if pod.Spec.ResourceClaims == nil {
		ops = append(ops, PatchOperation{Op: "add", Path: "/spec/resourceClaims", Value: entries})
	} else {
		for _, e := range entries {
			ops = append(ops, PatchOperation{Op: "add", Path: "/spec/resourceClaims/-", Value: e})
		}
	}
	return ops, nil
}

// ensureTemplate makes want in its namespace, or finds it there as the
// webhook made it, and returns its name. One of another content under the
// name is an error (someone changed it; the pod would get another request
// than it asks).
func (tr *Translator) ensureTemplate(ctx context.Context, want *resourcev1.ResourceClaimTemplate) (string, error) {
	api := tr.client.ResourceV1().ResourceClaimTemplates(want.Namespace)
	_, err := api.Create(ctx, want, metav1.CreateOptions{})
	if err == nil || !apierrors.IsAlreadyExists(err) {
		if err != nil {
			return "", fmt.Errorf("ResourceClaimTemplate %s/%s: %w", want.Namespace, want.Name, err)
		}
		return want.Name, nil
	}
	have, err := api.Get(ctx, want.Name, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("ResourceClaimTemplate %s/%s: %w", want.Namespace, want.Name, err)
	}
	if !equality.Semantic.DeepEqual(have.Spec, want.Spec) {
		return "", &Denial{Causes: []string{fmt.Sprintf("ResourceClaimTemplate %s/%s is not the request mgpu-webhook made under that name (changed since); delete it, and the webhook makes it again", want.Namespace, want.Name)}}
	}
	return want.Name, nil
}

// AsksSeed reports whether a container of the pod asks for a resource the
// translation rewrites.
func AsksSeed(pod *corev1.Pod) bool {
	for _, l := range [][]corev1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for i := range l {
			for _, n := range []corev1.ResourceName{ResourceCore, ResourceMemory, ResourceACKCore, ResourceACKMemory} {
				_, lim := l[i].Resources.Limits[n]
				_, req := l[i].Resources.Requests[n]
				if lim || req {
					return true
				}
			}
		}
	}
	return false
}
