"""mmspec_ray.drafters"""
