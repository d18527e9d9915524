package admission

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// DefaultExplainInterval is how often unschedulable pods are looked at.
const DefaultExplainInterval = 10 * time.Second

// ExplainReason is the reason of the events the explainer posts, the
// scheduler's own.
const ExplainReason = "FailedScheduling"

// Explainer tells the owner of a pod that cannot be scheduled because no
// node runs its compute policy: the scheduler says only "didn't match
// Pod's node affinity/selector" (on a DRA node, "cannot allocate all
// claims"). For each pending pod that asks for mgpu-core, or whose request
// the webhook translated into a claim, that the scheduler marked Unschedulable and whose policy no
// node's label names, it posts one Warning event (reason FailedScheduling)
// naming the policy and the policies the nodes run.
type Explainer struct {
	client   kubernetes.Interface
	log      *slog.Logger
	instance string
	told     map[types.UID]string // pod -> the policies of the nodes when told
}

// NewExplainer returns an explainer that reads and writes through client.
func NewExplainer(client kubernetes.Interface, log *slog.Logger) *Explainer {
	host, _ := os.Hostname()
	return &Explainer{client: client, log: log, instance: host, told: map[types.UID]string{}}
}

// Run explains at once and every interval until ctx ends.
func (e *Explainer) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if err := e.Once(ctx); err != nil && ctx.Err() == nil {
			e.log.Warn("explaining unschedulable pods; trying again", "err", err, "in", interval)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Once looks at the pending pods once.
func (e *Explainer) Once(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	pods, err := e.client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{
		FieldSelector: fields.AndSelectors(fields.OneTermEqualSelector("spec.nodeName", ""),
			fields.OneTermEqualSelector("status.phase", string(corev1.PodPending))).String(),
	})
	if err != nil {
		return fmt.Errorf("pending pods: %w", err)
	}
	var pending []*corev1.Pod
	for i := range pods.Items {
		if p := &pods.Items[i]; (asksCore(p) || translatedPod(p)) && unschedulable(p) {
			pending = append(pending, p)
		}
	}
	seen := map[types.UID]bool{}
	defer func() {
		for uid := range e.told {
			if !seen[uid] {
				delete(e.told, uid)
			}
		}
	}()
	for _, p := range pending {
		seen[p.UID] = true
	}
	if len(pending) == 0 {
		return nil
	}
	nodes, err := e.client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("nodes: %w", err)
	}
	run := map[string]bool{}
	for _, n := range nodes.Items {
		if v, ok := n.Labels[PolicyKey]; ok {
			run[v] = true
		}
	}
	runList := strings.Join(slices.Sorted(maps.Keys(run)), ", ")
	for _, p := range pending {
		pol, err := podPolicy(p)
		if err != nil || run[pol.String()] || e.told[p.UID] == runList {
			continue
		}
		msg := fmt.Sprintf("no node runs compute policy %s: no node is labelled %s=%s", pol, PolicyKey, pol)
		if runList == "" {
			msg += " (no node runs an mgpu policy)"
		} else {
			msg += fmt.Sprintf(" (nodes run %s); set the pod's annotation %s to one of those, or give a node of %s", runList, PolicyKey, pol)
		}
		if err := e.post(ctx, p, msg); err != nil {
			return err
		}
		e.told[p.UID] = runList
		e.log.Info("explained", "pod", p.Namespace+"/"+p.Name, "policy", pol.String())
	}
	return nil
}

func (e *Explainer) post(ctx context.Context, p *corev1.Pod, msg string) error {
	now := metav1.Now()
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s.%x", p.Name, now.UnixNano()), Namespace: p.Namespace},
		InvolvedObject: corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: p.Namespace,
			Name: p.Name, UID: p.UID, ResourceVersion: p.ResourceVersion},
		Reason: ExplainReason, Message: msg, Type: corev1.EventTypeWarning,
		Source:         corev1.EventSource{Component: "mgpu-webhook"},
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
		ReportingController: "mgpu.io/webhook", ReportingInstance: e.instance,
	}
	if _, err := e.client.CoreV1().Events(p.Namespace).Create(ctx, ev, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("event of pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	return nil
}

// asksCore reports whether a container of the pod asks for mgpu-core.
func asksCore(p *corev1.Pod) bool {
	for _, l := range [][]corev1.Container{p.Spec.InitContainers, p.Spec.Containers} {
		for _, c := range l {
			if _, ok := c.Resources.Limits[ResourceCore]; ok {
				return true
			}
			if _, ok := c.Resources.Requests[ResourceCore]; ok {
				return true
			}
		}
	}
	return false
}

// translatedPod reports whether the pod's GPU request is a translated one
// (a claim of a template the webhook made): on a DRA node the scheduler
// says only "cannot allocate all claims".
func translatedPod(p *corev1.Pod) bool {
	for _, c := range p.Spec.ResourceClaims {
		if c.ResourceClaimTemplateName != nil && strings.HasPrefix(*c.ResourceClaimTemplateName, TemplatePrefix) {
			return true
		}
	}
	return false
}

// unschedulable reports whether the scheduler gave up on the pod for now.
func unschedulable(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
			return true
		}
	}
	return false
}
